"""Render the configuration reference (docs/configuration.md) from the settings models, so the
documentation cannot drift from the code: `python -m dynpart.settings_doc > docs/configuration.md`."""

from __future__ import annotations

from collections.abc import Iterator

from pydantic import BaseModel
from pydantic_settings import BaseSettings

from dynpart.settings import NESTED, AgentSettings, PlannerSettings


def _rows(model: type[BaseModel], prefix: str, path: tuple[str, ...] = ()) -> Iterator[str]:
    for name, field in model.model_fields.items():
        at = (*path, name)
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            yield from _rows(field.annotation, prefix, at)  # a group: one row per setting in it
            continue
        default = "(host name)" if at == ("identity",) else field.get_default(call_default_factory=True)
        yield (f"| `{'.'.join(at)}` | `{prefix}{NESTED.join(at).upper()}` | `{default!r}` | "
               f"{field.description or ''} |")


def _table(cls: type[BaseSettings], command: str) -> str:
    prefix = cls.model_config.get("env_prefix", "")
    rows = [f"## `{command}`\n", f"Environment variables start with `{prefix}`. "
            "Precedence: flags, then environment, then the `--config` YAML file, then defaults. "
            "A dotted setting is nested in the YAML file (`kube: {backoff_max_s: 30}`). A key of the file that is "
            "not a setting of this version (a newer version's, or a misspelling) is ignored with a warning that "
            "names it, so that an agent an upgrade has not replaced yet starts with the new version's file; "
            f"so is an environment variable starting with `{prefix}` that names no setting (one naming no "
            "setting inside a nested one, `KUBE__...`, is an error; a Kubernetes service link is left alone); "
            "an unknown flag or value, or a key given twice in the file, is an error.\n",
            "| setting | environment variable | default | meaning |", "|---|---|---|---|", *_rows(cls, prefix)]
    return "\n".join(rows) + "\n"


def render() -> str:
    return ("# Configuration reference\n\nGenerated from `dynpart/settings.py` by "
            "`python -m dynpart.settings_doc`; a test checks it is current.\n\n"
            + _table(PlannerSettings, "dynpart planner run") + "\n" + _table(AgentSettings, "dynpart agent run"))


if __name__ == "__main__":
    print(render(), end="")
