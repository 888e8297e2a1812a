"""Remote code: the Python files a model folder's ``auto_map`` entries name, run only when trusted.

``target.trust_remote_code`` decides, in ``admit``: off, a folder that needs code stops the stage before anything is
loaded, naming the files and the key; on, ``admit`` returns the folder as a ``TrustedFolder``. The decision travels
with that value, not with the process: every loader passes ``trust_remote_code=trusted(folder)`` and a server launched
for it gets ``--trust-remote-code``, while the same folder reached any other way (a string, ``Path(folder)``) is not
trusted and transformers refuses its code. The ``.py``
files are part of ``target.fingerprint``, their sha256 (``hashes``) of infer's engine.json. Code from another
repository (``repo--module.Class``) is refused.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

from eaglepipe.core.errors import UserError

log = logging.getLogger(__name__)

CONFIGS = ("config.json", "tokenizer_config.json", "processor_config.json", "preprocessor_config.json")
"""The files whose ``auto_map`` names classes in remote code."""


class TrustedFolder(type(Path())):
    """A model folder whose remote code ``admit`` was told to run (a ``Path`` in every other respect)."""


def files(folder) -> list[str]:
    """The code files (relative to ``folder``) that the ``auto_map`` entries of its ``CONFIGS`` name."""
    folder, needed = Path(folder), set()
    for name in CONFIGS:
        path = folder / name
        auto_map = json.loads(path.read_text()).get("auto_map") if path.exists() else None
        for value in (auto_map or {}).values():
            for ref in value if isinstance(value, list) else [value]:
                if not ref:
                    continue
                if "--" in ref:
                    raise UserError(
                        f"{path}: auto_map names {ref!r}, code in another repository, which is never "
                        "downloaded: copy its files into the folder and name them without the repository"
                    )
                needed.add(ref.rsplit(".", 1)[0].replace(".", "/") + ".py")
    return sorted(needed)


def admit(folder, trust: bool) -> Path:
    """``folder`` as a ``Path`` when it needs no remote code, as a ``TrustedFolder`` when it does and ``trust`` is on;
    stop here (a UserError naming the files and the key) when it does and ``trust`` is off."""
    folder = Path(folder)
    needed = files(folder)
    if not needed:
        return folder
    missing = [f for f in needed if not (folder / f).exists()]
    if missing:
        raise UserError(f"{folder}: auto_map names code that is not in the folder: {', '.join(missing)}")
    if not trust:
        raise UserError(
            f"{folder} needs remote code ({', '.join(needed)}), which runs only when asked: read it, then "
            "set target.trust_remote_code: true"
        )
    log.info("target.trust_remote_code: running %s's %s", folder, ", ".join(needed))
    return TrustedFolder(folder)


def trusted(folder) -> bool:
    """Whether ``folder`` is one that ``admit`` trusted (what every ``from_pretrained`` of it passes)."""
    return isinstance(folder, TrustedFolder)


def hashes(folder) -> dict[str, str]:
    """{file: sha256} of every ``.py`` file in ``folder`` (the ``auto_map`` files and what they import)."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(Path(folder).glob("*.py"))}
