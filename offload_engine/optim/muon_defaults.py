"""torch.optim.Muon's defaults in torch 2.13, in a module without torch: the optimizer's
math, its hyperparameter checks and the planner's cost model (``owners``) all read them."""

DEFAULT_NS_COEFFICIENTS = (3.4445, -4.775, 2.0315)
DEFAULT_EPS = 1e-7
DEFAULT_NS_STEPS = 5
ADJUST_LR_FNS = (None, "original", "match_rms_adamw")
