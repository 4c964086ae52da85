"""How far apart two runs of a model on the same input may be.

The same input in batches of other shapes (other padding, other rows beside it), or in another
process, goes through other float32 reductions of the math library's kernels: ~1e-5 apart at times,
seen in CI. A request given another input's output differs by orders of magnitude more.
"""

VECTOR_ATOL = 1e-4
