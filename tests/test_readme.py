from pathlib import Path

from otel_forge.tables import SECTIONS, render

README = Path(__file__).parent.parent / "README.md"


def test_readme_tables_match_the_code():
    text = README.read_text()
    for name in SECTIONS:
        assert f"<!-- {name}:begin -->" in text and f"<!-- {name}:end -->" in text
    assert render(text) == text, "README tables are stale: run `python -m otel_forge.tables README.md`"


def test_every_metric_appears_in_the_readme():
    from otel_forge.names import METRICS

    text = README.read_text()
    assert all(f"`{spec.name}`" in text for spec in METRICS)
