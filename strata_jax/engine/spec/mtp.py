"""The MTP drafter (`--drafter mtp`): the model's own next-token-prediction (NextN) layer.

Not wired yet: it needs the window programs to hand back the main model's hidden states (forward(...,
with_hidden=True)) and the glm4moe family's model/mtp.py. Until then `--drafter mtp` is refused with a
clear error, at start, naming the setting.
"""

from __future__ import annotations

from ...config import ConfigError


class MtpDrafter:
    name = "mtp"

    def __init__(self, model, runner):
        n_nextn = getattr(model.spec, "n_nextn", 0) or 0
        if n_nextn == 0:
            raise ConfigError(f"drafter = 'mtp': this {model.spec.architecture} model has no next-token-prediction "
                              "(nextn) layer; use --drafter ngram or draft:PATH.gguf")
        raise ConfigError("drafter = 'mtp': the MTP drafter is not available in this version yet; use --drafter "
                          "ngram or draft:PATH.gguf")
