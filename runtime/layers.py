"""Quantized layers that drop into mlx-lm's architectures in place of Linear, SwitchLinear
and Embedding.

Each holds packed codes (uint32) and fp16 scales as laid out in docs/FORMAT.md, plus the
spec (bits, group size, rotation seed, padding) as plain attributes. A forward pass
rotates the activations once with the tensor's seed, zero-pads them to `padded_in`, and
calls the kernel `turboquant.kernels` dispatches for the device: W x = (W R)(R^T x).
"""

from __future__ import annotations

import contextlib
import math

import mlx.core as mx
import mlx.nn as nn

from turboquant import kernels
from turboquant.kernels import dispatch
from turboquant.kernels.group import bind_rotate_padded, reshaped, rotate_padded
from turboquant.kernels.reference import check_bits, is_trellis, words_per_row
from turboquant.stages import unrotate


def spec_bits(spec):
    """What a layer keeps as `bits` for a QuantSpec: its bits, or a trellis code's
    TrellisBits (the kernels choose by it)."""
    if spec.codec != "trellis":
        return spec.bits
    from turboquant.stages.trellis import TrellisBits

    return TrellisBits(spec.bits, spec.trellis_state_bits, spec.trellis_values,
                       spec.trellis_block, spec.trellis_version)


def padded(in_features: int, group_size: int) -> int:
    return math.ceil(in_features / group_size) * group_size


class _TQBase(nn.Module):
    """Spec and shared helpers; subclasses set codes, scales and (optionally) bias."""

    # A Module keeps its arrays as dict items, and MLX sets and removes them through these
    # (`layer.codes = ...`, `update`, `load_weights`, `layer.bias = None`, `del layer.bias`):
    # each tells the layer (`_arrays_changed`) that what it derived from them is stale, and
    # everyone else (`_arrays_version`: linear groups, compiled decode steps).
    def __setitem__(self, key, value):
        super().__setitem__(key, value)
        self._arrays_changed()
        _bump_arrays_version()

    def __delitem__(self, key):
        super().__delitem__(key)
        self._arrays_changed()
        _bump_arrays_version()

    def pop(self, key, *default):
        if key in self:  # Module.__setattr__ pops every plain attribute's name
            self._arrays_changed()
            _bump_arrays_version()
        return super().pop(key, *default)

    def _arrays_changed(self) -> None:
        """Drop what was derived from the arrays (nothing, unless a subclass keeps some)."""

    def _set_spec(self, input_dims, output_dims, bits, group_size, seed, padded_in):
        check_bits(bits)
        padded_in = padded_in or padded(input_dims, group_size)
        if padded_in % group_size or padded_in < input_dims:
            raise ValueError(
                f"padded_in {padded_in} must be a multiple of group_size {group_size} "
                f"and at least in_features {input_dims}"
            )
        self.input_dims = int(input_dims)
        self.output_dims = int(output_dims)
        self.bits = bits if bits == "ternary" or is_trellis(bits) else int(bits)
        self.group_size = int(group_size)
        self.seed = int(seed)
        self.padded_in = int(padded_in)
        return padded_in

    @property
    def spec(self):
        """The codec's QuantSpec for this layer's weights."""
        from turboquant.stages import QuantSpec

        b = self.bits
        codec = {}
        if is_trellis(b):
            codec = dict(codec="trellis", trellis_state_bits=b.state_bits,
                         trellis_values=b.values, trellis_block=b.block,
                         trellis_version=b.version)
            b = b.bits
        return QuantSpec(
            bits=b,
            group_size=self.group_size,
            seed=self.seed,
            in_features=self.input_dims,
            padded_in=self.padded_in,
            refit=True,
            **codec,
        )

    def check_input(self, x: mx.array) -> None:
        if x.shape[-1] != self.input_dims:
            raise ValueError(
                f"{type(self).__name__} expects inputs with last axis {self.input_dims}, "
                f"got {tuple(x.shape)}"
            )

    def rotate_input(self, x: mx.array) -> mx.array:
        """R^T x along the last axis in float32, zero-padded to padded_in."""
        self.check_input(x)
        return rotate_padded(x, self.seed, self.padded_in)

    def _decode_rows(self, codes, scales) -> mx.array:
        """Dense float32 rows in the original basis (..., input_dims): for tests and debugging."""
        w = kernels.dequantize(codes, scales, self.bits, self.group_size, self.padded_in)
        return unrotate(w[..., : self.input_dims], self.seed)

    def _extra_repr(self) -> str:
        return (
            f"input_dims={self.input_dims}, output_dims={self.output_dims}, "
            f"bits={self.bits}, group_size={self.group_size}"
        )


# Changes whenever a TurboQuant layer's arrays are set or removed: a LinearGroup compares
# its members with their layers' arrays, and a compiled decode step (`fuse`) traces again,
# only after it changed, not on every decode call.
_arrays_version = 0


def _bump_arrays_version() -> None:
    global _arrays_version
    _arrays_version += 1


class TQLinear(_TQBase):
    """y = x W^T + b with W stored as TurboQuant codes: codes (out, words), scales (out, groups)."""

    def __init__(
        self,
        input_dims: int,
        output_dims: int,
        bias: bool = False,
        *,
        bits=4,
        group_size: int = 64,
        seed: int = 0,
        padded_in: int | None = None,
        in_scales: bool = False,
    ):
        super().__init__()
        p = self._set_spec(input_dims, output_dims, bits, group_size, seed, padded_in)
        self.codes = mx.zeros((output_dims, words_per_row(p, bits)), dtype=mx.uint32)
        self.scales = mx.zeros((output_dims, p // group_size), dtype=mx.float16)
        if bias:
            self.bias = mx.zeros((output_dims,))
        if in_scales:  # format 2: W = decode(codes, scales) * in_scales, column by column
            self.in_scales = mx.ones((input_dims,), dtype=mx.float16)
        self.freeze()
        self._alone = LinearGroup([self])  # a plain attribute: read on every call

    @classmethod
    def from_quantized(cls, qt, bias: mx.array | None = None) -> "TQLinear":
        """From a `turboquant.stages.QuantizedTensor` (and an optional bias)."""
        out, inp = qt.shape
        s = qt.spec
        layer = cls(inp, out, bias is not None, bits=spec_bits(s), group_size=s.group_size,
                    seed=s.seed, padded_in=s.padded_in, in_scales=qt.in_scales is not None)
        layer.codes, layer.scales = qt.codes, qt.scales
        if bias is not None:
            layer.bias = bias
        if qt.in_scales is not None:
            layer.in_scales = qt.in_scales
        return layer

    @property
    def weight(self) -> mx.array:
        """The dense decoded weight (out, in), float32. Materialises the whole matrix."""
        w = self._decode_rows(self["codes"], self["scales"])
        t = self.get("in_scales")
        return w if t is None else w * t.astype(mx.float32)

    def member(self) -> kernels.Member:
        """This weight as a member of a kernel group (`kernels.tq_linear_group`)."""
        return kernels.Member(
            self["codes"], self["scales"], self.bits, self.group_size, self.input_dims,
            self.output_dims, self.padded_in, self.seed, self.get("bias"),
            self.get("in_scales"),
        )

    def __call__(self, x: mx.array) -> mx.array:
        if x.shape[-1] != self.input_dims:
            self.check_input(x)  # raises, naming the shapes
        alone = self._alone
        return alone.outputs(x, alone.extras)[0]

    def group(self) -> "LinearGroup":
        """The LinearGroup of this layer alone (a grouped layer's is its siblings')."""
        return self._alone


class LinearGroup:
    """TQLinears that read the same input, run as one `kernels.tq_linear_group` call.

    Keeps the members' description and what a backend prepared for them (kernel layouts,
    launch arguments) until a layer's arrays are replaced. The first member called with a
    new x computes every output; the others take theirs for that same x, and the outputs
    are let go once every member has taken its own (nothing outlives the forward pass).
    A plain object, not a Module: the layers' parameters are not listed twice.

    `extras` (`kernels.Extras`) is what the members' calls do around the product while a
    fused decoder block (`runtime.fuse`) has it set: the norm before, the residual after.
    `ready` holds the outputs such a block computed before its attention calls the members.
    `rope_dims` (`pair_rows`): the head size of a q/k/v group whose calls will ask for RoPE,
    told to the backend (its "rope_dims" in `prepared`) so its kernel may do it.
    """

    def __init__(self, layers: list[TQLinear]):
        self.layers = layers
        self.members: tuple[kernels.Member, ...] = ()
        self.prepared: dict = {}  # the backend's; "rope_dims" is ours (`pair_rows`)
        self.bound: dict = {}  # (x's shape and dtype, extras' mode, kernel choice) -> f(x, extras)
        self.checked = -1  # the `_arrays_version` at which the members were last checked
        # [x, outputs, bit mask of the members yet to take theirs]: ints, not a set, whose
        # methods would be builtin calls every token
        self.pending: list | None = None
        self.everyone = (1 << len(layers)) - 1
        self.extras = kernels.NO_EXTRAS
        # (x, outputs) that a fused decoder block computed for its attention's calls on x
        self.ready: tuple[mx.array, list[mx.array]] | None = None
        self.rope_dims = 0
        # a model's head: its prefill logits may never be evaluated (mlx-lm evaluates only
        # the cache), so its many-token calls take no eager kernel (`dispatch.graph_only`)
        self.lazy = False

    def pair_rows(self, head: int) -> None:
        """Tell the backend that calls will ask for RoPE over heads of `head` (a fused
        block's q/k/v): what it prepared so far is let go, to be built for it."""
        self.rope_dims = head
        self.prepared, self.bound = self._fresh(), {}

    def _fresh(self) -> dict:
        """An empty `prepared`, but for the RoPE head size the backend is told."""
        return {"rope_dims": self.rope_dims} if self.rope_dims else {}

    def output(self, x: mx.array, index: int) -> mx.array:
        """Member `index`'s output for x."""
        pending = self.pending
        if pending is None or pending[0] is not x:
            pending = self.pending = [x, self.outputs(x, self.extras), self.everyone]
        pending[2] &= ~(1 << index)
        if not pending[2]:
            self.pending = None
        return pending[1][index]

    def outputs(self, x: mx.array, extras=kernels.NO_EXTRAS, views=None,
                read_as=None) -> list[mx.array]:
        """Every member's output for x, with `extras` around the product; in the shapes
        `views` (one per member) if given; x read in the shape `read_as` if given (the
        same values, x row-contiguous: an attention's heads as o_proj's row).

        A decode step (a few tokens) runs the group call bound for x's shape and dtype
        (`kernels.bind_linear_group`): the host builds each token's graph with only the
        launch left to do (CUDA's reads x's memory as `read_as` without a reshape).
        Prefill, whose shapes vary, calls `tq_linear_group`."""
        if self.checked != _arrays_version:  # some TQLinear's arrays changed: ours?
            self._check_members()
        shape = x.shape
        width = shape[-1] if read_as is None else read_as[-1]
        if x.size > dispatch.MATVEC_MAX_TOKENS * width:
            x = x if read_as is None else x.reshape(read_as)
            with dispatch.graph_only() if self.lazy else contextlib.nullcontext():
                return reshaped(kernels.tq_linear_group(x, self.members, self.prepared,
                                                        extras), views)
        # what `bind_linear_group` chose depends on the device and the registered kernels
        # (`dispatch.backend()` on whether it is a GPU; the type's enum hashes in Python)
        on_gpu = mx.default_device().type == mx.gpu
        key = (shape, x.dtype, extras.mode, on_gpu, dispatch.GENERATION[0], views, read_as)
        try:  # not `.get`: a method call on every token, where a miss is once per shape
            run = self.bound[key]
        except KeyError:
            run = self.bound[key] = self._bind(x, extras, views, read_as)
        return run(x, extras)

    def _bind(self, x: mx.array, extras, views, read_as):
        if read_as is None:
            return kernels.bind_linear_group(x, self.members, self.prepared, extras, views)
        return kernels.bind_linear_group(x.reshape(read_as), self.members, self.prepared,
                                         extras, views, given=tuple(x.shape))

    def _check_members(self) -> None:
        """New or replaced weights: describe them anew, and let go of what was derived
        from the old ones."""
        if not self._current():
            self.members = tuple(layer.member() for layer in self.layers)
            self.prepared, self.bound = self._fresh(), {}
        self.checked = _arrays_version

    def _current(self) -> bool:
        if len(self.members) != len(self.layers):
            return False
        for m, layer in zip(self.members, self.layers):
            if (m.codes is not layer["codes"] or m.scales is not layer["scales"]
                    or m.bias is not layer.get("bias")
                    or m.in_scales is not layer.get("in_scales")):
                return False
        return True


# At or below this many (token, expert) pairs a switch layer's call is bound per shape
# (a decode step's; the shapes are few): prefill's vary with the prompt, each seen once.
BIND_MAX_PAIRS = 64


class _SwitchBase(_TQBase):
    """The expert product TQSwitchLinear and expert streaming's StreamedSwitchLinear share.

    A decode step calls it per projection with the same shapes every token: the call is
    bound once per shape (`kernels.dispatch.bind_gather_unrotated` where the backend
    rotates inside its launch, else `bind_gather` with the rotation's plan), so a token
    pays little more than the launch, where each Python call costs the GPU's host time."""

    def __init__(self):
        super().__init__()
        # (shapes, dtypes, device, kernel choice) -> (rotate, product); set past Module's
        # __setattr__, which would make a dict a Module item, listed with the parameters
        object.__setattr__(self, "_bound", {})

    def _arrays_changed(self) -> None:
        """Bound calls keep the last codes they ran and those codes' kernel layout: they go
        with the arrays."""
        self._bound.clear()

    def apply_experts(
        self, x, indices, codes, scales, *, sorted_indices: bool = False, bias=None
    ) -> mx.array:
        """The expert product on given stacks: `codes[indices[p]]` serves pair p.

        The resident call and expert streaming (`runtime.experts`, which passes its slot
        pool and slot numbers) share it, so both run the same kernel on the same values.
        `bias` holds the bias rows already picked per pair (indices.shape + (out,)).
        """
        if x.shape[-1] != self.input_dims:
            self.check_input(x)  # raises, naming the shapes
        if indices.size > BIND_MAX_PAIRS:
            y = self._experts(x, indices, codes, scales, sorted_indices)
        else:
            # what `bind_gather` chose depends on the device and the registered kernels
            # (the type's enum hashes in Python); attributes only, no calls
            on_gpu = mx.default_device().type == mx.gpu
            key = (x.shape, x.dtype, indices.shape, indices.dtype, codes.shape, scales.shape,
                   sorted_indices, on_gpu, dispatch.GENERATION[0])
            try:  # not `.get`: a method call on every token, where a miss is once per shape
                rotate, product = self._bound[key]
            except KeyError:
                rotate, product = self._bound[key] = self._bind_product(x, indices, codes, scales,
                                                                sorted_indices)
            y = product(x if rotate is None else rotate(x), codes, scales, indices)
        if bias is not None:
            y = y + mx.expand_dims(bias, -2)
        return y

    def _experts(self, x, indices, codes, scales, sorted_indices: bool) -> mx.array:
        """The product unbound (prefill): the rotated x through `kernels.tq_gather`."""
        return kernels.tq_gather(
            self.rotate_input(x), codes, scales, indices, self.bits, self.group_size,
            self.output_dims, self.padded_in, sorted_indices=sorted_indices,
            out_dtype=x.dtype,
        )

    def _bind_product(self, x, indices, codes, scales, sorted_indices: bool):
        """(rotate, product) for arguments of these shapes: what `_experts` does, as
        product(rotate(x), codes, scales, indices); rotate None where the backend's
        product rotates x itself (`dispatch.bind_gather_unrotated`)."""
        fused = dispatch.bind_gather_unrotated(
            x, codes, scales, indices, self.bits, self.group_size, self.output_dims,
            self.padded_in, seed=self.seed, sorted_indices=sorted_indices, out_dtype=x.dtype)
        if fused is not None:
            return None, fused
        rotate = bind_rotate_padded(self.input_dims, self.seed, self.padded_in)
        product = dispatch.bind_gather(
            rotate(x), codes, scales, indices, self.bits, self.group_size, self.output_dims,
            self.padded_in, sorted_indices=sorted_indices, out_dtype=x.dtype,
        )
        return rotate, product


class TQSwitchLinear(_SwitchBase):
    """mlx-lm's SwitchLinear with TurboQuant experts.

    codes (E, out, words) uint32, scales (E, out, groups) float16, bias (E, out).

    All experts of one layer and projection share one rotation (docs/FORMAT.md), so the
    input is rotated once for every expert it is routed to.
    """

    def __init__(
        self,
        input_dims: int,
        output_dims: int,
        num_experts: int,
        bias: bool = False,
        *,
        bits=4,
        group_size: int = 64,
        seed: int = 0,
        padded_in: int | None = None,
    ):
        super().__init__()
        p = self._set_spec(input_dims, output_dims, bits, group_size, seed, padded_in)
        self.num_experts = int(num_experts)
        self.codes = mx.zeros((num_experts, output_dims, words_per_row(p, bits)), dtype=mx.uint32)
        self.scales = mx.zeros((num_experts, output_dims, p // group_size), dtype=mx.float16)
        if bias:
            self.bias = mx.zeros((num_experts, output_dims))
        self.freeze()

    @classmethod
    def from_quantized(cls, experts, bias: mx.array | None = None) -> "TQSwitchLinear":
        """From a list of per-expert QuantizedTensors sharing one spec."""
        specs = {(q.spec.bits, q.spec.group_size, q.spec.seed, q.spec.padded_in) for q in experts}
        shapes = {tuple(q.shape) for q in experts}
        if len(specs) != 1 or len(shapes) != 1:
            raise ValueError(f"experts differ in spec or shape: {sorted(map(str, specs | shapes))}")
        out, inp = experts[0].shape
        s = experts[0].spec
        layer = cls(inp, out, len(experts), bias is not None, bits=spec_bits(s),
                    group_size=s.group_size, seed=s.seed, padded_in=s.padded_in)
        layer.codes = mx.stack([q.codes for q in experts])
        layer.scales = mx.stack([q.scales for q in experts])
        if bias is not None:
            layer.bias = bias
        return layer

    @property
    def weight(self) -> mx.array:
        """Dense decoded experts (E, out, in), float32. Materialises everything."""
        return self._decode_rows(self["codes"], self["scales"])

    def __call__(self, x: mx.array, indices: mx.array, sorted_indices: bool = False) -> mx.array:
        bias = self["bias"][indices] if "bias" in self else None
        return self.apply_experts(
            x, indices, self["codes"], self["scales"], sorted_indices=sorted_indices, bias=bias
        )


class TQEmbedding(_TQBase):
    """nn.Embedding with TurboQuant rows: a lookup decodes only the rows it needs.

    Rows are rotated along the hidden axis like any (out=vocab, in=hidden) weight, so
    `as_linear` (a tied lm_head) is a TQLinear product with no decode at all.
    """

    def __init__(
        self,
        num_embeddings: int,
        dims: int,
        *,
        bits=4,
        group_size: int = 64,
        seed: int = 0,
        padded_in: int | None = None,
        dtype: mx.Dtype = mx.float32,
    ):
        super().__init__()
        p = self._set_spec(dims, num_embeddings, bits, group_size, seed, padded_in)
        self.num_embeddings = int(num_embeddings)
        self.dims = int(dims)
        self.dtype = dtype
        self.codes = mx.zeros((num_embeddings, words_per_row(p, bits)), dtype=mx.uint32)
        self.scales = mx.zeros((num_embeddings, p // group_size), dtype=mx.float16)
        self.freeze()

    @classmethod
    def from_quantized(cls, qt, dtype: mx.Dtype = mx.float32) -> "TQEmbedding":
        vocab, dims = qt.shape
        s = qt.spec
        layer = cls(vocab, dims, bits=spec_bits(s), group_size=s.group_size, seed=s.seed,
                    padded_in=s.padded_in, dtype=dtype)
        layer.codes, layer.scales = qt.codes, qt.scales
        return layer

    @property
    def weight(self) -> mx.array:
        """The dense decoded table (vocab, dims), float32. Materialises everything."""
        return self._decode_rows(self["codes"], self["scales"])

    def __call__(self, ids: mx.array) -> mx.array:
        rows = kernels.tq_embed(
            ids, self["codes"], self["scales"], self.bits, self.group_size, self.padded_in
        )
        return unrotate(rows[..., : self.dims], self.seed).astype(self.dtype)

    def _extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.dims}, bits={self.bits}, group_size={self.group_size}"

    def as_linear(self, x: mx.array) -> mx.array:
        """x times the table's transpose: a tied head, whose prefill logits may never be
        evaluated, so no eager kernel runs them (`dispatch.graph_only`)."""
        prefill = x.size > dispatch.MATVEC_MAX_TOKENS * x.shape[-1]
        with dispatch.graph_only() if prefill else contextlib.nullcontext():
            return kernels.tq_linear(self.rotate_input(x), self["codes"], self["scales"],
                                     self.bits, self.group_size, self.num_embeddings,
                                     self.padded_in).astype(x.dtype)


__all__ = ["LinearGroup", "TQEmbedding", "TQLinear", "TQSwitchLinear", "padded"]
