"""Measuring tools: what an optimized program compiles to on a target the machine may not have.

    cuda_target.py   the deviceless H100 compile target (JAX's CUDA plugin + ptxas), installed once
                     outside the user's environment (`python -m measure.cuda_target install`)
    xla_target.py    compile any JAX function for an H100 in a subprocess and read its thunk
                     sequence: kernel launches, bytes, temporary memory, PTX
    compare.py       our plan and emitted executable against `jax.jit`'s, per workload (`sd15 plan`)

They sit above the driver (they compile `eqsat.optimize` functions) and below the model and the
benchmarks, which use them.
"""
