"""The driver: `eqsat.optimize` and what it owns above the pipeline's stages.

    optimize.py       optimize / Optimized / Lowered: lift -> build -> saturate -> extract -> emit, timed
    cache.py          the plan cache on disk (`eqsat cache info|clear`)
    differentiate.py  derivatives of an optimized function
    explain.py        the fusions that did not happen around heavy kernels, and why

It imports every stage below it (eqsat, extract, emit) and nothing imports it but the public face
(`eqsat/__init__.py`, lazily), the model (`sd15`), the measuring tools and the benchmarks.
"""
