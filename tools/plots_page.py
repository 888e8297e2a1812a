"""The HTML page template for `dvc plots show` that works offline: vega, vega-lite and vega-embed inlined.

DVC's default page loads these libraries from a CDN; this template carries them instead, so the page draws without
network. The libraries are installed once from the npm registry, at the pinned versions below, into ``--prefix``
(default ``.venv/plots``, never committed), then read from their ``build/*.min.js`` files.

The template follows dvc-render's contract: it holds ``{plot_divs}`` (where DVC puts the charts) and
``{refresh_tag}``, and no ``{scripts}`` (where DVC would put its CDN script tags).

    python3 tools/plots_page.py --out .venv/plots/page.html
    dvc plots show --html-template .venv/plots/page.html
"""

import json
import re
import subprocess
import sys
from pathlib import Path

import click

LIBRARIES = {"vega": "5.33.1", "vega-lite": "5.23.0", "vega-embed": "6.29.0"}  # loaded in this order
PLACEHOLDERS = ("{plot_divs}", "{refresh_tag}", "{scripts}")

PAGE = """<!DOCTYPE html>
<html>
<head>
    <meta charset="utf-8">
    {refresh_tag}
    <title>eaglepipe plots</title>
LIBRARY_TAGS
    <style>
        body { font-family: sans-serif; }
        table { border-spacing: 15px; }
    </style>
</head>
<body>
    {plot_divs}
</body>
</html>
"""


def installed_version(prefix: Path, name: str) -> str | None:
    manifest = prefix / "node_modules" / name / "package.json"
    return json.loads(manifest.read_text())["version"] if manifest.exists() else None


def install(prefix: Path) -> None:
    """npm-install the pinned libraries into ``prefix`` unless exactly those versions are there."""
    if all(installed_version(prefix, n) == v for n, v in LIBRARIES.items()):
        return
    prefix.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [
            "npm",
            "install",
            "--prefix",
            str(prefix),
            "--save-exact",
            "--no-audit",
            "--no-fund",
            *(f"{n}@{v}" for n, v in LIBRARIES.items()),
        ],
        check=True,
    )


def page(scripts: dict[str, str]) -> str:
    """The template with each library's code (name -> JavaScript, in load order) inlined in a <script> element.
    Raises ValueError when a library's code holds one of DVC's placeholders (DVC would substitute inside it)."""
    tags = []
    for name, code in scripts.items():
        found = [p for p in PLACEHOLDERS if p in code]
        if found:
            raise ValueError(f"{name} holds DVC's placeholder(s) {found}")
        code = re.sub(r"</(script)", r"<\\/\1", code, flags=re.IGNORECASE)  # would close the element early
        tags.append(f'    <script type="text/javascript">/* {name} */\n{code}\n    </script>')
    return PAGE.replace("LIBRARY_TAGS", "\n".join(tags))


@click.command(help=__doc__.split("\n\n")[0])
@click.option("--prefix", default=".venv/plots", show_default=True, help="npm prefix the libraries are installed into.")
@click.option("--out", default=".venv/plots/page.html", show_default=True, help="The HTML template to write.")
def main(prefix, out) -> None:
    prefix = Path(prefix)
    install(prefix)
    scripts = {
        n: (prefix / "node_modules" / n / "build" / f"{n}.min.js").read_text(encoding="utf-8") for n in LIBRARIES
    }
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(page(scripts), encoding="utf-8")
    print(f"{out}: {', '.join(f'{n}@{v}' for n, v in LIBRARIES.items())} inlined", file=sys.stderr)


if __name__ == "__main__":
    main()
