"""Model loading, geometry, and modality labelling."""

from .geometry import Geometry
from .loading import DEFAULT_MODEL, load_model
from .modality import TEXT, TOKEN_IDS, VISUAL, Labelling, LabellingError, labels_from_input_ids, visual_token_ids
from .rope import rope_inv_freq

__all__ = ["DEFAULT_MODEL", "TEXT", "TOKEN_IDS", "VISUAL", "Geometry", "Labelling", "LabellingError", "labels_from_input_ids", "load_model", "rope_inv_freq",
           "visual_token_ids"]
