"""MkDocs hook: the benchmark plots in bench/figures/ become part of the site as figures/<name>.png.

The benchmarks write their plots to bench/figures/ (outside docs/); copying them into docs/ would leave two
copies to drift apart. Pages link them as `figures/<name>.png`, and the strict build checks those links like
any other.
"""

from pathlib import Path

from mkdocs.structure.files import File

FIGURES = Path(__file__).resolve().parents[2] / "bench" / "figures"


def on_files(files, config):
    for png in sorted(FIGURES.glob("*.png")):
        files.append(File.generated(config, f"figures/{png.name}", abs_src_path=str(png)))
    return files
