"""DeepSpeed's ZeRO-3 model-state estimate, for comparison (AdamW only, no NVMe).

``estimate_zero3`` returns what ``deepspeed.runtime.zero.stage3.
estimate_zero3_model_states_mem_needs`` returns (research/planning_inspection.md A1): bytes
per GPU and per node ("per CPU"), from the parameter count P, the largest layer L (most
parameters one module holds itself), GPUs per node n, nodes N, G = n*N, b = 1.5:

- params and optimizer on CPU: GPU 4L; CPU 18P/N*b with zero_init, else max(4n, 18/N)*P*b
- optimizer on CPU:            GPU 4L + 2P/G; CPU 16P/N*b, else max(4n, 16/N)*P*b
- nothing offloaded:           GPU 4L + 18P/G; CPU 4L*n*b with zero_init, else 4P*n*b

16 = fp32 param + fp32 grad + Adam m + v; 18 adds the fp16 param; 4L the fp16 param and
grad of the gathered largest layer.

``ours_vs_deepspeed`` lines up our AdamW-only bytes with the "optimizer on CPU" row. The
deliberate differences (docs/plan.md):

- no fp32 gradient copy: FSDP2 reduce-scatters bf16 gradients that stay on the GPU, and the
  step reads them there, so the host holds 12 bytes per parameter (master, m, v), not 16;
  the GPU holds 2P/G more (the bf16 gradient shard);
- no blanket 1.5x: pinned memory is the store's ``cpu_budget``, counted exactly, bucket
  padding included;
- the gathered working set is the largest FSDP2 unit (a whole decoder block, or the root
  with embeddings and head), not the largest single module.
"""

from __future__ import annotations


def estimate_zero3(total_params: int, largest_layer_params: int, num_gpus_per_node: int = 1,
                   num_nodes: int = 1, cpu_offload: bool = True, cpu_offload_params: bool = True,
                   zero_init: bool = True, additional_buffer_factor: float = 1.5) -> tuple[int, int, int]:
    """(cpu bytes per node, gpu bytes per GPU, largest layer bytes), as DeepSpeed computes them."""
    total_gpus = num_nodes * num_gpus_per_node
    gpus_factor = 1 / num_nodes
    largest_layer_memory = 4 * largest_layer_params
    if cpu_offload:
        if cpu_offload_params:
            gpu_mem = largest_layer_memory
            if zero_init:
                cpu_mem = total_params * 18 * gpus_factor * additional_buffer_factor
            else:
                cpu_mem = total_params * max(4 * num_gpus_per_node, 18 * gpus_factor) * additional_buffer_factor
        else:
            gpu_mem = largest_layer_memory + int(2 * total_params / total_gpus)
            if zero_init:
                cpu_mem = total_params * 16 * gpus_factor * additional_buffer_factor
            else:
                cpu_mem = total_params * max(4 * num_gpus_per_node, 16 * gpus_factor) * additional_buffer_factor
    else:
        gpu_mem = largest_layer_memory + int(18 * total_params / total_gpus)
        if zero_init:
            cpu_mem = largest_layer_params * 4 * num_gpus_per_node * additional_buffer_factor
        else:
            cpu_mem = total_params * 4 * num_gpus_per_node * additional_buffer_factor
    return int(cpu_mem), int(gpu_mem), largest_layer_memory


def table(total_params: int, largest_layer_params: int, gpus_per_node: int, nodes: int) -> dict:
    """DeepSpeed's three ZeRO-3 rows (zero_init on, as ``*_all_cold`` prints first)."""
    rows = {}
    for key, offload, offload_params in (("offload_param_and_optimizer", True, True),
                                         ("offload_optimizer", True, False),
                                         ("no_offload", False, False)):
        cpu, gpu, _ = estimate_zero3(total_params, largest_layer_params, gpus_per_node, nodes,
                                     cpu_offload=offload, cpu_offload_params=offload_params)
        rows[key] = {"gpu_bytes_per_gpu": gpu, "cpu_bytes_per_node": cpu}
    return rows


def ours_vs_deepspeed(total_params: int, largest_layer_params: int, gpus_per_node: int,
                      nodes: int, our_state_per_node: int, our_gpu_params_grads: int,
                      our_unit_bytes: int) -> dict:
    """Our AdamW-only model-state bytes against DeepSpeed's "optimizer on CPU" row, with
    each difference as its own term so they add up."""
    ds_cpu, ds_gpu, ds_layer = estimate_zero3(total_params, largest_layer_params, gpus_per_node,
                                              nodes, cpu_offload=True, cpu_offload_params=False)
    g = gpus_per_node * nodes
    fp32_grads = 4 * total_params / nodes
    return {
        "deepspeed_cpu_bytes_per_node": ds_cpu,
        "deepspeed_gpu_bytes_per_gpu": ds_gpu,
        "deepspeed_without_buffer_factor_cpu": int(16 * total_params / nodes),
        "deepspeed_fp32_grads_cpu": int(fp32_grads),
        "ours_state_bytes_per_node": our_state_per_node,
        "ours_gpu_params_grads_per_gpu": our_gpu_params_grads,
        "ours_gathered_unit_bytes": our_unit_bytes,
        "deepspeed_largest_layer_bytes": ds_layer,
        "differences": [
            "no fp32 gradient copy on the host (-4 B/param): bf16 gradients stay on the GPU "
            "(+2 B/param/W there)",
            "no 1.5x buffer factor: the pinned pool is counted exactly; bucket padding (under "
            "a bucket per array where Muon and AdamW bundles with masters meet) is given separately",
            "gathered working set = largest FSDP2 unit, not the largest module",
        ],
        "gpus": g,
    }
