"""The attribute of an optimizer under which others leave callables for its ``close()``.

``ZeroMuon.close`` runs them last, once each; checkpoint/writer_lock.py puts the release
of a checkpoint folder's writer lock there (optim knows nothing of checkpoints). A module
of its own, free of torch, so that the writer lock (and ``import deepspeed``, which holds
it) does not import torch to learn a name.
"""

CLOSE_CALLBACKS = "_oe_close_callbacks"
