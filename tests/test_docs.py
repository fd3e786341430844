"""The docs a user reads in a hurry stay true to the code: every reason has its fix, the README stays short.

The reasons are read from the package's source with ``ast``: the leading token of every string that starts
``token: `` (``"capture_failed: ..."``, ``f"shape_unstable: {...}"``) and every plain token passed to
``disable(...)`` or ``rollback(...)`` (``"no_cuda"``). docs/troubleshooting.md gives each one a ``### `token` ``
heading.
"""

from __future__ import annotations

import ast
import inspect
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import lightning.pytorch as pl
import pytest
import yaml  # type: ignore[import-untyped]

from benchmarks.core.figures import round_ratios
from benchmarks.core.markdown import rounds_ratio
from lightning_cudagraph import CUDAGraphCallback
from lightning_cudagraph._options.options import FULL_ITERATION, OPTIONS, SCOPES
from lightning_cudagraph.health import LEVEL_NUMBERS, CUDAGraphReport
from lightning_cudagraph.strategy_names import _REGISTERED  # importing it registers the names

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "lightning_cudagraph"
DOCS = ROOT / "docs"
README = ROOT / "README.md"
TROUBLESHOOTING = DOCS / "troubleshooting.md"

#: Strings that start like a reason but are not one: the package's name as a message prefix, and the prefix the
#: stage machine puts before every rollback's own reason.
NOT_REASONS = {"lightning_cudagraph", "rollback"}
_TOKEN = re.compile(r"^([a-z]+(?:_[a-z]+)*): ")
_PLAIN_TOKEN = re.compile(r"[a-z]+(?:_[a-z]+)*")
_HEADING = re.compile(r"^### `([a-z_]+)`\s*$", re.MULTILINE)


def _leading_text(node: ast.AST) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr) and node.values and isinstance(node.values[0], ast.Constant):
        return str(node.values[0].value)
    return None


def reasons_in_code() -> dict[str, list[str]]:
    """Every reason token of the package, with where it is made (``path:line``)."""
    found: dict[str, list[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            where = f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', 0)}"
            text = _leading_text(node)
            match = _TOKEN.match(text) if text is not None else None
            if match and match.group(1) not in NOT_REASONS:
                found.setdefault(match.group(1), []).append(where)
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args):
                continue
            first = node.args[0]
            token = str(first.value) if isinstance(first, ast.Constant) else ""
            if node.func.attr in ("disable", "rollback") and _PLAIN_TOKEN.fullmatch(token):
                found.setdefault(token, []).append(where)
    return found


def reasons_in_troubleshooting() -> set[str]:
    return set(_HEADING.findall(TROUBLESHOOTING.read_text()))


def test_the_reason_scan_finds_the_known_reasons() -> None:
    # A scan that found nothing would let the two tests below pass on an empty page.
    found = reasons_in_code()
    assert {"no_cuda", "capture_failed", "memory_budget", "not_engaged", "not_faster"} <= found.keys()
    assert {"optimizer_setting_changed", "metric_in_graph", "shape_unstable", "parity"} <= found.keys()


def test_every_reason_in_the_code_has_a_troubleshooting_entry() -> None:
    missing = {token: where for token, where in reasons_in_code().items() if token not in reasons_in_troubleshooting()}
    assert not missing, f"docs/troubleshooting.md has no `### `token`` entry for: {missing}"


def test_the_troubleshooting_page_lists_no_reason_the_code_lacks() -> None:
    stale = reasons_in_troubleshooting() - reasons_in_code().keys()
    assert not stale, f"docs/troubleshooting.md explains reasons the package no longer gives: {sorted(stale)}"


def test_the_readme_is_at_most_160_lines() -> None:
    lines = len(README.read_text().splitlines())
    assert lines <= 160, f"README.md has {lines} lines; move the detail to docs/"


def test_the_readme_test_command_is_the_one_ci_runs() -> None:
    readme = README.read_text()
    assert 'pip install torch==2.13.0 -e ".[test]" && python -m pytest -q' in readme
    assert "python -m pytest -q" in (ROOT / ".ci" / "run").read_text()
    assert 'torch==2.13.0 -e ".[test]"' in (ROOT / "scripts" / "fresh_venv.sh").read_text()
    example = "python examples/gpt.py fit --config examples/gpt_small.yaml"
    assert f'pip install torch==2.13.0 -e ".[examples]" && {example}' in readme
    assert (ROOT / "examples" / "gpt.py").is_file()
    assert (ROOT / "examples" / "gpt_small.yaml").is_file()


def test_the_readme_links_to_files_that_exist() -> None:
    links = re.findall(r"\]\(([^)#]+)\)", README.read_text())
    local = [link for link in links if not link.startswith("http")]
    assert any(link.startswith("docs/") for link in local)
    assert [link for link in local if not (ROOT / link).exists()] == []


def test_every_page_of_the_site_navigation_exists() -> None:
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    pages = [next(iter(entry.values())) for entry in config["nav"]]
    assert "troubleshooting.md" in pages
    assert [page for page in pages if not (DOCS / page).is_file()] == []


def test_the_api_reference_covers_every_public_name() -> None:
    tree = ast.parse((PACKAGE / "__init__.py").read_text())
    public = next(
        ast.literal_eval(node.value)
        for node in tree.body
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets)
    )
    api = (DOCS / "api.md").read_text()
    missing = [name for name in public if name != "__version__" and f"::: lightning_cudagraph.{name}\n" not in api]
    assert missing == []


def test_the_readme_results_table_is_the_benchmarks_page_table() -> None:
    # docs/benchmarks.md is generated from the committed JSON; the README's tables must be its "README table"s.
    page = (DOCS / "benchmarks.md").read_text()
    sections = [part.split("\n## ", 1)[0] for part in page.split("## README table")[1:]]
    assert len(sections) == 2, "the results table and the table of steps that are not one graph"
    expected = [line for section in sections for line in section.splitlines() if line.startswith("|")]
    shown = [line for line in README.read_text().splitlines() if line.startswith("| ") or line.startswith("|---")]
    assert expected
    assert shown == expected


def test_the_docs_build_keeps_the_site_in_site_by_default(tmp_path):
    """The README's command leaves the built site where a reader can open it (a stand-in mkdocs writes the pages)."""
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "build_docs.sh", tmp_path / "scripts" / "build_docs.sh")
    mkdocs = tmp_path / "mkdocs"
    mkdocs.write_text(
        '#!/usr/bin/env bash\nwhile [[ $1 != --site-dir ]]; do shift; done\nmkdir -p "$2"\necho ok > "$2/index.html"\n'
    )
    mkdocs.chmod(0o755)
    done = subprocess.run(
        ["bash", str(tmp_path / "scripts" / "build_docs.sh")],
        env={**os.environ, "MKDOCS": str(mkdocs)},
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "site" / "index.html").is_file(), done.stdout
    assert "site" in done.stdout


def test_every_python_snippet_with_a_strategy_name_imports_the_package() -> None:
    """The names exist once ``lightning_cudagraph`` is imported: a snippet that uses one must show the import."""
    pages = [README, ROOT / "docs" / "index.md"]
    bare = []
    for page in pages:
        for block in re.findall(r"```python\n(.*?)```", page.read_text(), re.DOTALL):
            if re.search(r"strategy=\"(ddp_)?cudagraph", block) and "lightning_cudagraph" not in block:
                bare.append(f"{page.name}: {block.strip().splitlines()[0]}")
    assert not bare, f"snippets that use a strategy name without importing lightning_cudagraph: {bare}"


def misspelt_name_section() -> str:
    """The troubleshooting section on a strategy name Lightning does not know (up to the next ``## `` heading)."""
    page = TROUBLESHOOTING.read_text()
    heading = "## A strategy name Lightning does not know\n"
    assert heading in page, "docs/troubleshooting.md lost its section on a misspelt strategy name"
    return page.split(heading, 1)[1].split("\n## ", 1)[0]


def test_the_troubleshooting_page_lists_every_registered_strategy_name() -> None:
    # Derived from the registry, so a name added to _REGISTERED without this list fails here.
    listed = re.findall(r"^- `([a-z0-9_]+)`$", misspelt_name_section(), re.MULTILINE)
    assert listed == list(_REGISTERED)


def test_the_troubleshooting_page_quotes_lightnings_error_for_a_misspelt_strategy_name() -> None:
    """What a user sees for ``Trainer(strategy="cudagraph_atn")`` is the page's quote, word for word."""
    with pytest.raises(ValueError) as raised:
        pl.Trainer(strategy="cudagraph_atn", accelerator="cpu", logger=False, enable_checkpointing=False)
    message = str(raised.value)
    assert "`strategy='cudagraph_atn'`" in message
    assert f"ValueError: {message}\n" in misspelt_name_section()
    # The page says the message names no close match: were Lightning to name one, the page would be wrong.
    assert "cudagraph_attn" not in message


def test_the_readme_comparison_with_compile_and_thunder_is_the_committed_json() -> None:
    source = "benchmarks/results/compile/compile_bf16-mixed.json"
    record = json.loads((ROOT / source).read_text())
    paragraph = README.read_text().split(f"`{source}` compares", 1)[1].split("\n\n", 1)[0]
    env = record["environment"]
    assert env["gpu"] in paragraph and f"torch {env['torch']}" in paragraph and record["precision"] in paragraph
    order = ["compile_reduce_overhead", "thunder", "full_iteration", "full_iteration+compile"]
    rounds = {m: {r["variant"]: r["round_ms"] for r in got["results"]} for m, got in record["models"].items()}
    expected = [
        rounds_ratio(round_ratios(rounds[model]["eager"], rounds[model][variant]))
        for model in ("small", "medium")
        for variant in order
    ]
    assert re.findall(r"\d+\.\d+x \(\d+\.\d+-\d+\.\d+x\)", paragraph) == expected


# =================================================================== the glossary and the metric list
GLOSSARY = DOCS / "glossary.md"
_ROW = re.compile(r"^\| ([^|]+?) \| (.+) \|$", re.MULTILINE)


def glossary() -> dict[str, str]:
    """The glossary's words and their meanings (the table's rows, its header aside)."""
    rows = dict(_ROW.findall(GLOSSARY.read_text()))
    rows.pop("word", None)
    return rows


def test_the_glossary_levels_are_the_ladders_levels() -> None:
    named = re.findall(r"`([^`]+)`", glossary()["level"])
    assert named == list(LEVEL_NUMBERS)


def test_the_glossary_names_every_registered_whole_step_strategy() -> None:
    named = set(re.findall(r"`([a-z0-9_]+)`", glossary()["whole step"])) & set(_REGISTERED)
    whole = {name for name, (_, options, _) in _REGISTERED.items() if options.get("scope") == [FULL_ITERATION]}
    assert named == whole


def test_every_code_name_in_the_glossary_is_an_option_a_level_or_a_strategy() -> None:
    known = {option.name for option in OPTIONS} | set(LEVEL_NUMBERS) | set(_REGISTERED) | set(SCOPES)
    named = {name.rstrip("=") for meaning in glossary().values() for name in re.findall(r"`([^`]+)`", meaning)}
    assert named - known == set()


def test_every_glossary_word_is_a_word_of_the_package() -> None:
    source = " ".join(path.read_text() for path in PACKAGE.rglob("*.py")).lower()
    unused = [word for word in glossary() if word.lower() not in source]
    assert unused == []


def test_the_callbacks_docstring_names_every_logged_metric() -> None:
    emitted = re.findall(r'"(\w+)":', inspect.getsource(CUDAGraphReport.metrics))
    documented = set(re.findall(r"``cudagraph/(\w+)``", CUDAGraphCallback.__doc__ or ""))
    assert emitted and set(emitted) - documented == set()
