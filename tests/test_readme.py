import re
from pathlib import Path

from otel_forge.tables import SECTIONS, render

ROOT = Path(__file__).parent.parent
README = ROOT / "README.md"
REFERENCE = ROOT / "docs" / "reference.md"
ARCHITECTURE = ROOT / "docs" / "architecture.md"


def test_reference_tables_match_the_code():
    text = REFERENCE.read_text()
    for name in SECTIONS:
        assert f"<!-- {name}:begin -->" in text and f"<!-- {name}:end -->" in text
    assert render(text) == text, "tables are stale: run `python -m otel_forge.tables docs/reference.md`"


def test_every_metric_appears_in_the_reference():
    from otel_forge.names import METRICS

    text = REFERENCE.read_text()
    assert all(f"`{spec.name}`" in text for spec in METRICS)


def test_the_readme_is_a_front_page_and_its_links_resolve():
    text = README.read_text()
    assert len(text.splitlines()) <= 250
    links = re.findall(r"\]\(([^)#]+)\)", text)
    assert links and [link for link in links if not (ROOT / link).exists()] == []


PACKAGE = ROOT / "otel_forge"


def _architecture_map() -> set[str]:
    """The modules the architecture map names, as paths (nesting by 2-space indent)."""
    text = ARCHITECTURE.read_text()
    block = text[text.index("## Architecture") :].split("```")[1]
    folders: list[str] = []
    named: set[str] = set()
    for line in block.splitlines():
        depth = (len(line) - len(line.lstrip())) // 2
        names = line.strip().split("  ")[0].split()
        if not names or not all(name.endswith((".py", "/")) for name in names):
            continue  # a description carried over to the next line
        del folders[depth:]
        for name in names:
            if name.endswith("/"):
                folders.append(name.rstrip("/"))
            else:
                named.add("/".join([*folders, name]))
    return named


def test_the_architecture_map_names_every_module_file_for_file():
    modules = {
        str(path.relative_to(PACKAGE.parent))
        for path in PACKAGE.rglob("*.py")
        if path.name not in ("__init__.py", "__main__.py")
    }
    named = _architecture_map() - {"otel_forge/__init__.py"}
    assert sorted(modules - named) == [] and sorted(named - modules) == []


def test_no_module_imports_a_layer_above_it():
    # cli -> mlflow -> pipeline -> collectors -> the modules at the top of the package.
    layers = ["cli", "mlflow", "pipeline", "collectors"]
    problems = []
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE).parts
        if parts == ("__init__.py",):
            continue  # the public face re-exports from every layer
        own = layers.index(parts[0]) if parts[0] in layers else len(layers)
        for line in path.read_text().splitlines():
            words = line.split()
            if words[:1] in (["from"], ["import"]) and len(words) > 1 and words[1].startswith("otel_forge."):
                target = words[1].split(".")[1]
                if target in layers and layers.index(target) < own:
                    problems.append(f"{path.relative_to(PACKAGE)} imports {words[1]}")
    assert problems == []
