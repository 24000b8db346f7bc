"""The cost model: device profiles and the roofline cost of kernel terms (no e-graph library here).

    from eqsat.cost import get_device, kernel_cost, node_cost
    kernel_cost(term, "h100").seconds
"""

from eqsat.cost.devices import A100, CPU, DEVICES, H100, H200, Device, get_device
from eqsat.cost.hosting import hosted_reductions, hosts_of
from eqsat.cost.roofline import (
    COMPUTE_OPS,
    DENSE_OPS,
    VIEW_OPS,
    Cost,
    count_kernels,
    dag_cost,
    hosted_cost,
    kernel_cost,
    kernel_reads,
    kernels,
    merge_cost,
    merge_fraction,
    node_cost,
    own_flops,
)

__all__ = [
    "A100", "CPU", "DEVICES", "H100", "H200", "Device", "get_device",
    "COMPUTE_OPS", "DENSE_OPS", "VIEW_OPS", "Cost", "count_kernels", "dag_cost", "hosted_cost",
    "hosted_reductions", "hosts_of", "kernel_cost",
    "kernel_reads", "kernels", "merge_cost", "merge_fraction", "node_cost", "own_flops",
]
