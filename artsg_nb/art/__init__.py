"""ART drop-in: `SGLangBackend` trains an `art.TrainableModel` with artsg_nb's server and loop.

    from artsg_nb.art import SGLangBackend     # instead of: from art.local import LocalBackend
    backend = SGLangBackend()                  # instead of: backend = LocalBackend()

Everything else of an ART notebook (TrainableModel, the rollout function, gather, train, log)
stays. See backend.py for what is and is not supported, convert.py for how ART's trajectories
become token-exact ones. Importing this package imports `art` (openpipe-art, an optional extra
of the kernel environment) and undoes the transformers patch `import art` applies, which breaks
our transformers' forward passes (backend._undo_transformers_patch); `import artsg_nb` never
imports `art`.
"""
import os

# litellm (imported by `art`) fetches a price list from GitHub at import and warns when offline
# (GPU hosts are); its bundled copy is used then anyway. Effective when this is imported first.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

import art  # noqa: E402,F401  (first, so that its patch is undone before any model runs)

from .backend import ArtVersionError, SGLangBackend, _undo_transformers_patch, check_art_version  # noqa: E402
from .convert import UnsupportedTrajectory  # noqa: E402

_undo_transformers_patch()

__all__ = ["ArtVersionError", "SGLangBackend", "UnsupportedTrajectory", "check_art_version"]
