"""The key correction's per-head query bases and their base64 float16 codec in a plan file."""

from __future__ import annotations

import base64
import binascii
import math

import numpy as np

from ..errors import PlanError
from ._checks import check_choice, check_int, check_keys


class KeyBasis:
    """Per-layer, per-KV-head orthonormal bases ``U [L, H_kv, D, r]`` of the key correction.

    Learned offline from calibration queries (top eigenvectors of ``E[q qᵀ]`` over the
    post-RoPE queries a KV head serves). A key ``k`` stored at low bits as ``k̂`` also stores
    ``ẑ ≈ Uᵀ (k - k̂)`` and is read as ``k̂ + U ẑ``: the part of the error queries can see.
    Held as float16 (as written in the plan); part of the plan, like the bit table, not of
    the per-token cache bytes.
    """

    def __init__(self, basis):
        a = np.asarray(basis.array if isinstance(basis, KeyBasis) else basis, dtype=np.float16)
        if a.ndim != 4:
            raise PlanError("key_basis.shape", "must be [num_layers, num_kv_heads, head_dim, rank]", list(a.shape))
        if not np.isfinite(a).all():
            raise PlanError("key_basis", "holds non-finite values", show_value=False)
        a.setflags(write=False)
        self.array = a

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.array.shape)

    def __eq__(self, other) -> bool:
        return isinstance(other, KeyBasis) and np.array_equal(self.array, other.array)

    __hash__ = None

    def __repr__(self) -> str:
        return f"KeyBasis(shape={list(self.shape)})"

    def to_dict(self) -> dict:
        data = np.ascontiguousarray(self.array, dtype="<f2").tobytes()
        return {"dtype": "float16", "shape": list(self.shape), "base64": base64.b64encode(data).decode("ascii")}

    @classmethod
    def from_dict(cls, d, expected_shape: tuple[int, int, int, int] | None = None) -> "KeyBasis":
        """Decode a plan's ``key_basis`` section; with ``expected_shape`` (the plan's
        ``[num_layers, num_kv_heads, head_dim, key_correction_rank]``) the stated shape is
        checked before anything is decoded."""
        check_keys(d, "key_basis", ["dtype", "shape", "base64"])
        check_choice(d["dtype"], "key_basis.dtype", ("float16",))
        shape = d["shape"]
        if not isinstance(shape, list) or len(shape) != 4:
            raise PlanError("key_basis.shape", "must be a list [num_layers, num_kv_heads, head_dim, rank]", shape)
        for i, n in enumerate(shape):
            check_int(n, f"key_basis.shape[{i}]", 1)
        if expected_shape is not None and tuple(shape) != tuple(expected_shape):
            raise PlanError("key_basis.shape", f"must be [num_layers, num_kv_heads, head_dim, key_correction_rank] = "
                            f"{list(expected_shape)}", shape)
        text = d["base64"]
        if not isinstance(text, str):
            raise PlanError("key_basis.base64", "must be a base64 string", show_value=False)
        n_bytes = 2 * math.prod(shape)
        try:
            raw = base64.b64decode(text.encode("ascii"), validate=True)
        except (binascii.Error, UnicodeEncodeError):
            raise PlanError("key_basis.base64", "is not valid base64", show_value=False) from None
        if len(raw) != n_bytes:
            raise PlanError("key_basis.base64", f"decodes to {len(raw)} bytes; shape {shape} in float16 needs "
                            f"{n_bytes} (truncated or altered?)", show_value=False)
        return cls(np.frombuffer(raw, dtype="<f2").reshape(shape))
