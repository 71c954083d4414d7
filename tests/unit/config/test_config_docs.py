"""docs/config.md is generated from the schema's field docstrings (scripts/dev/gen_config_docs.py): it must be
what the generator writes today, so a key added, renamed or re-documented shows up in the docs."""

import importlib.util

from megaframe.config.keys import schema_keys
from tests.e2e.helpers import ROOT

spec = importlib.util.spec_from_file_location(
    "gen_config_docs", ROOT / "scripts" / "dev" / "gen_config_docs.py"
)
gen = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gen)


def test_config_md_is_generated_from_the_schema():
    text = gen.render()
    assert gen.OUT.read_text() == text, (
        f"docs/config.md is stale (the schema or conf/ changed): regenerate it with `{gen.COMMAND}`"
    )


def test_every_config_key_is_documented():
    text = gen.OUT.read_text()
    keys = schema_keys()
    # a group (model, logging.wandb, model.rope_scaling) is documented through its fields
    leaves = {k for k in keys if not any(other.startswith(k + ".") for other in keys)}
    assert {k for k in leaves if f"| `{k}` |" not in text} == set()


def test_a_field_without_a_docstring_is_named():
    import dataclasses

    @dataclasses.dataclass
    class Group:
        documented: int = 1
        """A doc."""
        bare: int = 2

    tables, missing = [], []
    gen.rows(Group, "g.", tables, missing, {})
    assert missing == ["g.bare"] and "| `g.documented` | int | `1` | A doc. |" in tables[0][1]
