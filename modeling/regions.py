"""Where a model's step may be compiled piece by piece: the target's step runs its embedding, each decoder layer and
its head through the `regions(fn, *args)` it is given (the torch backend's ModuleGraphs.regions), and the backend
runs each drafter graph as one piece. `Eager` (the default) calls fn; the GPU runtime's
regional compile (runtime/backends/torch_compile.py CompiledRegions) swaps in one compiled function per piece, so a
step of 64 layers compiles one GDN layer and one attention layer instead of 64 (every layer of a kind runs the same
code on its own weights, and torch.compile reuses a piece's graph across the layers it guards alike).

`views`: whether a layer gets its own slice of a pool (pool[i:i+1], layer index 0) rather than the whole pool and
its index: a compiled piece would otherwise specialise on the index and compile once per layer. The exported graphs
keep whole pools (a slice of a pool there is a copy in ONNX Runtime / TensorRT)."""
from __future__ import annotations


class Eager:
    views = False

    def __call__(self, fn, *args):
        return fn(*args)

    def model_call(self, fn, *args):
        """A call into the models from the step's glue (the step's pieces run inside it)."""
        return fn(*args)

    def layer_of(self, pool, index: int):
        """(the pool a layer's op takes, the layer's index in it)."""
        return (pool.narrow(0, index, 1), 0) if self.views else (pool, index)


EAGER = Eager()
