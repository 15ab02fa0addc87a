"""Per-head plan arrays (the key correction's query bases, the error-feedback metrics) and their
base64 float16 codec in a plan file."""

from __future__ import annotations

import base64
import binascii
import math
from typing import Mapping

import numpy as np

from ..errors import PlanError
from ._checks import check_choice, check_int, check_keys
from ._fields import ROTATIONS


class _PlanArray:
    """A read-only float16 array a plan carries (plan constants, not per-token cache bytes),
    written as ``{dtype, shape, base64}``. Subclasses name the plan key, the axes and the
    packing (the values written, in order)."""

    KEY = ""
    AXES = ""  # e.g. "[num_layers, num_kv_heads, head_dim, rank]"

    def __init__(self, array):
        a = np.asarray(array.array if isinstance(array, _PlanArray) else array, dtype=np.float16)
        if a.ndim != self.AXES.count(",") + 1:
            raise PlanError(f"{self.KEY}.shape", f"must be {self.AXES}", list(a.shape))
        if not np.isfinite(a).all():
            raise PlanError(self.KEY, "holds non-finite values", show_value=False)
        self._check(a)
        a.setflags(write=False)
        self.array = a

    def _check(self, a: np.ndarray) -> None:
        """Further checks of a subclass (raise PlanError)."""

    @staticmethod
    def _pack(a: np.ndarray) -> np.ndarray:
        """The values written to the file, flat."""
        return a.reshape(-1)

    @staticmethod
    def _unpack(flat: np.ndarray, shape: list[int]) -> np.ndarray:
        return flat.reshape(shape)

    @staticmethod
    def _packed_size(shape: list[int]) -> int:
        return math.prod(shape)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.array.shape)

    def __eq__(self, other) -> bool:
        return type(other) is type(self) and np.array_equal(self.array, other.array)

    __hash__ = None

    def __repr__(self) -> str:
        return f"{type(self).__name__}(shape={list(self.shape)})"

    def to_dict(self) -> dict:
        data = np.ascontiguousarray(self._pack(self.array), dtype="<f2").tobytes()
        return {"dtype": "float16", "shape": list(self.shape), "base64": base64.b64encode(data).decode("ascii")}

    @classmethod
    def from_dict(cls, d, expected_shape: tuple[int, ...] | None = None):
        """Decode the plan's section; with ``expected_shape`` (what the plan's geometry and
        quantizer imply) the stated shape is checked before anything is decoded."""
        key = cls.KEY
        check_keys(d, key, ["dtype", "shape", "base64"])
        check_choice(d["dtype"], f"{key}.dtype", ("float16",))
        shape = d["shape"]
        ndim = cls.AXES.count(",") + 1
        if not isinstance(shape, list) or len(shape) != ndim:
            raise PlanError(f"{key}.shape", f"must be a list {cls.AXES}", shape)
        for i, n in enumerate(shape):
            check_int(n, f"{key}.shape[{i}]", 1)
        if expected_shape is not None and tuple(shape) != tuple(expected_shape):
            raise PlanError(f"{key}.shape", f"must be {cls.AXES} = {list(expected_shape)}", shape)
        text = d["base64"]
        if not isinstance(text, str):
            raise PlanError(f"{key}.base64", "must be a base64 string", show_value=False)
        n_bytes = 2 * cls._packed_size(shape)
        try:
            raw = base64.b64decode(text.encode("ascii"), validate=True)
        except (binascii.Error, UnicodeEncodeError):
            raise PlanError(f"{key}.base64", "is not valid base64", show_value=False) from None
        if len(raw) != n_bytes:
            raise PlanError(f"{key}.base64", f"decodes to {len(raw)} bytes; shape {shape} in float16 needs "
                            f"{n_bytes} (truncated or altered?)", show_value=False)
        return cls(cls._unpack(np.frombuffer(raw, dtype="<f2"), shape))


class KeyBasis(_PlanArray):
    """Per-layer, per-KV-head orthonormal bases ``U [L, H_kv, D, r]`` of the key correction.

    Learned offline from calibration queries (top eigenvectors of ``E[q qᵀ]`` over the
    post-RoPE queries a KV head serves). A key ``k`` stored at low bits as ``k̂`` also stores
    ``ẑ ≈ Uᵀ (k - k̂)`` and is read as ``k̂ + U ẑ``: the part of the error queries can see.
    Held as float16 (as written in the plan); part of the plan, like the bit table, not of
    the per-token cache bytes.
    """

    KEY = "key_basis"
    AXES = "[num_layers, num_kv_heads, head_dim, key_correction_rank]"


class FeedbackMetric(_PlanArray):
    """Per-layer, per-kind (k, v), per-KV-head error metrics ``M [L, 2, H_kv, D, D]`` of the
    error-feedback encoder (:mod:`kvplan.kernels.feedback`), in the slots' stored frame (after the
    plan's rotations): keys' from the calibration queries' second moments, values' from the
    output projection, each scaled to a mean diagonal of 1 plus a damping on the diagonal. A
    plan constant like the key basis; written as the upper triangles (symmetric), float16."""

    KEY = "feedback_metric"
    AXES = "[num_layers, 2, num_kv_heads, head_dim, head_dim]"
    FRAME_KEYS = ("rotation", "key_pre_rope")  # the quantizer settings the stored frame is made of

    def __init__(self, array, frame=None):
        """``frame``: ``{"rotation": ..., "key_pre_rope": ...}``, the quantizer settings whose stored frame
        the metrics were computed in (schema 9; ``None``: not recorded, as in older files)."""
        super().__init__(array)
        if frame is None and isinstance(array, FeedbackMetric):
            frame = array.frame
        if frame is not None:
            check_keys(frame, f"{self.KEY}.frame", self.FRAME_KEYS)
            check_choice(frame["rotation"], f"{self.KEY}.frame.rotation", ROTATIONS)
            if not isinstance(frame["key_pre_rope"], bool):
                raise PlanError(f"{self.KEY}.frame.key_pre_rope", "must be true or false", frame["key_pre_rope"])
            frame = {k: frame[k] for k in self.FRAME_KEYS}
        self.frame = frame

    def __eq__(self, other) -> bool:
        return super().__eq__(other) and self.frame == other.frame

    __hash__ = None

    def to_dict(self) -> dict:
        d = super().to_dict()
        if self.frame is not None:
            d["frame"] = dict(self.frame)
        return d

    @classmethod
    def from_dict(cls, d, expected_shape: tuple[int, ...] | None = None, with_frame: bool = True):
        """As :meth:`_PlanArray.from_dict`, with the optional ``frame`` (``with_frame``: the file's schema
        version has it)."""
        if isinstance(d, Mapping) and "frame" in d:
            if not with_frame:
                raise PlanError(f"{cls.KEY}.frame", "needs schema_version 9", show_value=False)
            rest = {k: v for k, v in d.items() if k != "frame"}
            return cls(super().from_dict(rest, expected_shape), frame=d["frame"])
        return super().from_dict(d, expected_shape)

    def _check(self, a: np.ndarray) -> None:
        if a.shape[1] != 2 or a.shape[-1] != a.shape[-2]:
            raise PlanError(f"{self.KEY}.shape", f"must be {self.AXES}", list(a.shape))
        if not np.array_equal(a, np.swapaxes(a, -1, -2)):
            raise PlanError(self.KEY, "must hold symmetric matrices", show_value=False)
        try:
            np.linalg.cholesky(a.astype(np.float64))
        except np.linalg.LinAlgError:
            bad = np.argwhere(np.linalg.eigvalsh(a.astype(np.float64)).min(-1) <= 0)[0]
            raise PlanError(f"{self.KEY}[{bad[0]}][{bad[1]}][{bad[2]}]", "must be positive definite (layer "
                            f"{bad[0]}, {'kv'[bad[1]]}, KV head {bad[2]})", show_value=False) from None

    @staticmethod
    def _pack(a: np.ndarray) -> np.ndarray:
        rows, cols = np.triu_indices(a.shape[-1])
        return a[..., rows, cols].reshape(-1)

    @staticmethod
    def _unpack(flat: np.ndarray, shape: list[int]) -> np.ndarray:
        D = shape[-1]
        rows, cols = np.triu_indices(D)
        tri = flat.reshape(*shape[:-2], rows.size)
        out = np.zeros(shape, dtype=np.float16)
        out[..., rows, cols] = tri
        out[..., cols, rows] = tri
        return out

    @staticmethod
    def _packed_size(shape: list[int]) -> int:
        return math.prod(shape[:-2]) * shape[-1] * (shape[-1] + 1) // 2
