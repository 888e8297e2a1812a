"""What the text tests share: the reasoning presets' specs, a split's segments joined back, and the project's own
gate settings (params.yaml's infer.gates)."""

from helpers import ROOT

from eaglepipe.core import config
from eaglepipe.text import derive

THINK = derive.spec_from_params("think")
HARMONY = derive.spec_from_params("harmony", "harmony")
NONE = derive.spec_from_params("none")
GATES = config.load(ROOT / "params.yaml").infer.gates  # the project's own settings


def parts(split):
    return "".join(s for _, s in split.segments)
