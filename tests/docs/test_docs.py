"""The documentation site builds strictly: no broken link or anchor, no nav entry without its page, no page
left out of the nav, no missing include (mkdocs.yml sets `strict` and the validation levels; the build is
run here with --strict as well, so the test holds even if the config is loosened)."""

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _build(tmp_path, config=REPO / "mkdocs.yml"):
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "mkdocs",
            "build",
            "--strict",
            "-f",
            str(config),
            "-d",
            str(tmp_path / "site"),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )


def test_the_docs_site_builds_strictly_without_a_warning(tmp_path):
    result = _build(tmp_path)
    log = result.stdout + result.stderr
    assert result.returncode == 0, log
    assert "WARNING" not in log, log
    site = tmp_path / "site"
    # every page of the nav, the page that includes deploy/README.md, and the benchmark plots came out
    for page in ("index.html", "benchmarks/index.html", "deployment/index.html", "changelog/index.html"):
        assert (site / page).is_file(), page
    assert "Deploying csd-serve" in (site / "deployment" / "index.html").read_text()
    assert (site / "figures" / "speedup.png").is_file()


def test_a_broken_link_fails_the_build(tmp_path):
    """The check has teeth: the same configuration over a copy of the docs with one broken link fails."""
    docs = tmp_path / "docs"
    subprocess.run(["cp", "-r", str(REPO / "docs"), str(docs)], check=True)
    (docs / "index.md").write_text((docs / "index.md").read_text() + "\n[gone](no-such-page.md)\n")
    config = (REPO / "mkdocs.yml").read_text()
    config = config.replace("docs_dir: docs", f"docs_dir: {docs}").replace(
        "docs/hooks/figures.py", str(docs / "hooks" / "figures.py")
    )
    (tmp_path / "mkdocs.yml").write_text(config)
    result = _build(tmp_path, tmp_path / "mkdocs.yml")
    assert result.returncode != 0
    assert "no-such-page.md" in result.stdout + result.stderr


def test_readme_links_point_at_files_that_exist():
    """README is not part of the site, so the strict build does not see its links: check them here."""
    readme = (REPO / "README.md").read_text()
    links = re.findall(r"\]\(([^)\s]+)\)", readme)
    local = [link.split("#")[0] for link in links if not re.match(r"[a-z]+:", link)]
    assert "docs/index.md" in local
    missing = [link for link in local if link and not (REPO / link).exists()]
    assert not missing, missing
