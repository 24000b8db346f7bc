"""The static parameters of a convolution as the string key a `Conv` term carries.

`Conv(lhs, rhs, params, epilogue, ty)` holds everything `lax.conv_general_dilated` needs besides
its operands in `params`, a `;`-separated list of `name=value` fields, integer tuples as comma
lists (`types.ints_key`), in this fixed order:

    strides=1,1;padding=1,1,1,1;lhs_dilation=1,1;rhs_dilation=1,1;lhs_spec=0,3,1,2;rhs_spec=0,1,2,3;out_spec=0,3,1,2;feature_groups=1;batch_groups=1

`padding` is the flattened `(lo, hi)` pairs per spatial dimension; `lhs_spec`/`rhs_spec`/`out_spec`
are `lax.ConvDimensionNumbers` (batch/out-feature dimension, feature/in-feature dimension, then
the spatial dimensions, as positions in the operand). Precision and the accumulator type are not
part of the key: the output type comes from the term's type and its epilogue's `Acc`.

>>> p = ConvParams.from_lax((1, 1), ((1, 1), (1, 1)), (1, 1), (1, 1), ((0, 3, 1, 2), (0, 1, 2, 3), (0, 3, 1, 2)))
>>> ConvParams.parse(p.key) == p
True
"""

from __future__ import annotations

from dataclasses import dataclass

from eqsat.types import ints, ints_key

_FIELDS = ("strides", "padding", "lhs_dilation", "rhs_dilation", "lhs_spec", "rhs_spec", "out_spec",
           "feature_groups", "batch_groups")


@dataclass(frozen=True)
class ConvParams:
    strides: tuple[int, ...]
    padding: tuple[tuple[int, int], ...]
    lhs_dilation: tuple[int, ...]
    rhs_dilation: tuple[int, ...]
    lhs_spec: tuple[int, ...]
    rhs_spec: tuple[int, ...]
    out_spec: tuple[int, ...]
    feature_groups: int = 1
    batch_groups: int = 1

    @classmethod
    def from_lax(cls, window_strides, padding, lhs_dilation, rhs_dilation, dimension_numbers,
                 feature_group_count=1, batch_group_count=1) -> "ConvParams":
        """From `conv_general_dilated` equation params (explicit padding pairs, ConvDimensionNumbers)."""
        lhs_spec, rhs_spec, out_spec = dimension_numbers
        rank = len(window_strides)
        return cls(
            strides=tuple(int(s) for s in window_strides),
            padding=tuple((int(lo), int(hi)) for lo, hi in padding),
            lhs_dilation=tuple(int(d) for d in (lhs_dilation or (1,) * rank)),
            rhs_dilation=tuple(int(d) for d in (rhs_dilation or (1,) * rank)),
            lhs_spec=tuple(int(d) for d in lhs_spec),
            rhs_spec=tuple(int(d) for d in rhs_spec),
            out_spec=tuple(int(d) for d in out_spec),
            feature_groups=int(feature_group_count),
            batch_groups=int(batch_group_count),
        )

    @classmethod
    def from_eqn_params(cls, params: dict) -> "ConvParams":
        return cls.from_lax(params["window_strides"], params["padding"], params["lhs_dilation"],
                            params["rhs_dilation"], params["dimension_numbers"],
                            params["feature_group_count"], params["batch_group_count"])

    @property
    def key(self) -> str:
        values = {
            "strides": ints_key(self.strides),
            "padding": ints_key(v for pair in self.padding for v in pair),
            "lhs_dilation": ints_key(self.lhs_dilation),
            "rhs_dilation": ints_key(self.rhs_dilation),
            "lhs_spec": ints_key(self.lhs_spec),
            "rhs_spec": ints_key(self.rhs_spec),
            "out_spec": ints_key(self.out_spec),
            "feature_groups": str(self.feature_groups),
            "batch_groups": str(self.batch_groups),
        }
        return ";".join(f"{name}={values[name]}" for name in _FIELDS)

    @classmethod
    def parse(cls, key: str) -> "ConvParams":
        fields = dict(part.split("=", 1) for part in key.split(";"))
        if tuple(fields) != _FIELDS:
            raise ValueError(f"not a conv params key: {key!r}")
        flat_padding = ints(fields["padding"])
        return cls(
            strides=ints(fields["strides"]),
            padding=tuple(zip(flat_padding[::2], flat_padding[1::2])),
            lhs_dilation=ints(fields["lhs_dilation"]),
            rhs_dilation=ints(fields["rhs_dilation"]),
            lhs_spec=ints(fields["lhs_spec"]),
            rhs_spec=ints(fields["rhs_spec"]),
            out_spec=ints(fields["out_spec"]),
            feature_groups=int(fields["feature_groups"]),
            batch_groups=int(fields["batch_groups"]),
        )

    def lax_kwargs(self) -> dict:
        """Keyword arguments for `lax.conv_general_dilated` (besides operands and precision)."""
        from jax import lax

        return dict(
            window_strides=self.strides,
            padding=self.padding,
            lhs_dilation=self.lhs_dilation,
            rhs_dilation=self.rhs_dilation,
            dimension_numbers=lax.ConvDimensionNumbers(self.lhs_spec, self.rhs_spec, self.out_spec),
            feature_group_count=self.feature_groups,
            batch_group_count=self.batch_groups,
        )


def conv_params_key(params: dict) -> str:
    """The key of a `conv_general_dilated` equation's params."""
    return ConvParams.from_eqn_params(params).key
