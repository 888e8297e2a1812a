"""The package's layering, checked: a subpackage imports only those below it (docs/architecture.md draws it)."""

from helpers import ROOT

from eaglepipe.core import codedeps

# Lowest first; the packages of one row are peers and import none of each other.
LAYERS = [
    ("core",),
    ("target",),
    ("engines",),
    ("text",),
    ("dataset",),
    ("infer", "hidden"),
    ("drafter",),
    ("evaluate",),
    ("tools",),
]
RANK = {package: rank for rank, row in enumerate(LAYERS) for package in row}


def subpackage(dotted: str) -> str | None:
    parts = dotted.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "eaglepipe" else None


def test_every_subpackage_is_in_a_layer():
    found = {p.name for p in (ROOT / "eaglepipe").iterdir() if (p / "__init__.py").exists()}
    assert found == set(RANK)


def test_no_module_imports_a_layer_above_its_own_or_a_peer():
    wrong = []
    for path in sorted((ROOT / "eaglepipe").rglob("*.py")):
        own = path.relative_to(ROOT / "eaglepipe").parts[0]
        if own not in RANK:
            continue
        for name in codedeps.imported(path, ROOT):
            other = subpackage(name)
            if other in RANK and other != own and RANK[other] >= RANK[own]:
                wrong.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not wrong, "\n".join(sorted(set(wrong)))
