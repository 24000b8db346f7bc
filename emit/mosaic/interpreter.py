"""What jax 0.10.2's GPU interpret mode lacks and the Mosaic templates use, added to it.

    install()   wgmma reads an SMEM operand through `plgpu.transpose_ref` (idempotent; jax 0.10.2)

The compiled kernel multiplies a transposed SMEM operand natively (wgmma's K-major / MN-major
operand layouts; jax's `attention_mgpu.py` passes K so: `wgmma(acc, q, transpose_ref(k, (1, 0)))`).
The interpreter's wgmma callback turns an operand's transforms into an index range and fails on
the transpose ("'TransposeTransform' object has no attribute 'indices'"). `install()` replaces that
callback by the same body (read A, B and the accumulator from simulated SMEM, `acc + a @ b` in the
accumulator's dtype, store it back) that first applies a trailing transpose to the operand it reads:
the compiled kernel and the interpreted one are the same kernel. Anything else about the callback
is jax's own; any other transform after a transpose raises.
"""

from __future__ import annotations

import functools

import jax
import numpy as np

_INSTALLED = False


def _split_transpose(transforms) -> tuple[tuple, tuple[int, ...] | None]:
    """(the transforms before a trailing transpose, its permutation), or (transforms, None)."""
    from jax._src.state.types import TransposeTransform

    transforms = tuple(transforms)
    at = [i for i, t in enumerate(transforms) if isinstance(t, TransposeTransform)]
    if not at:
        return transforms, None
    if at != [len(transforms) - 1]:
        raise NotImplementedError(f"a wgmma operand transformed after a transpose: {transforms}")
    return transforms[:-1], tuple(transforms[-1].permutation)


def _wgmma(*, token, device_id, grid_point_coords, thread_id, acc_allocation_key_as_array, acc_transforms,
           acc_dtype, a_allocation_key_as_array, a_transforms, b_allocation_key_as_array, b_transforms,
           source_info=None):
    from jax._src.pallas.mosaic.interpret import utils as interpret_utils
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks as cb

    device_id, thread_id = int(device_id), int(thread_id)
    grid_point_coords = tuple(int(x) for x in grid_point_coords)
    operands = []
    for key, transforms in ((a_allocation_key_as_array, a_transforms), (b_allocation_key_as_array, b_transforms)):
        kept, permutation = _split_transpose(cb._remove_noop_transforms(transforms))
        operands.append((cb.HostAllocationKey.from_array(key), jax.tree.map(int, kept), permutation))
    acc_key = cb.HostAllocationKey.from_array(acc_allocation_key_as_array)
    acc_transforms = jax.tree.map(int, cb._remove_noop_transforms(acc_transforms))
    shared_memory = cb._get_shared_memory()
    global_thread_id = shared_memory.get_global_thread_id(device_id, thread_id)
    logging_info = interpret_utils.GPULoggingInfo(device_id=device_id, grid_point_coords=grid_point_coords,
                                                  thread_id=thread_id, source_info=source_info)
    values = []
    for key, transforms, permutation in operands:
        value, _, _ = shared_memory.get_buffer_content(key, interpret_utils.to_range(transforms), global_thread_id,
                                                       logging_info=logging_info)
        assert value is not None
        values.append(value if permutation is None else np.transpose(value, permutation))
    acc_range = interpret_utils.to_range(acc_transforms)
    acc, _, _ = shared_memory.get_buffer_content(acc_key, acc_range, global_thread_id, logging_info=logging_info)
    shared_memory.store_buffer_content(acc_key, acc_range, acc + np.matmul(*values, dtype=acc_dtype),
                                       global_thread_id, logging_info=logging_info)
    return token


def install() -> None:
    """Teach GPU interpret mode wgmma operands read through a transpose (idempotent)."""
    global _INSTALLED
    if _INSTALLED:
        return
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks

    if jax.__version__ != "0.10.2":
        raise NotImplementedError(f"the interpreter's wgmma callback is patched for jax 0.10.2, not {jax.__version__}")
    gpu_callbacks.wgmma = functools.update_wrapper(_wgmma, gpu_callbacks.wgmma)
    _INSTALLED = True
