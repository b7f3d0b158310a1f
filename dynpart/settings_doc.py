"""Render the configuration reference (docs/configuration.md) from the settings models, so the
documentation cannot drift from the code: `python -m dynpart.settings_doc > docs/configuration.md`."""

from __future__ import annotations

from pydantic_settings import BaseSettings

from dynpart.settings import AgentSettings, PlannerSettings


def _table(cls: type[BaseSettings], command: str) -> str:
    prefix = cls.model_config.get("env_prefix", "")
    rows = [f"## `{command}`\n", f"Environment variables start with `{prefix}`. "
            "Precedence: flags, then environment, then the `--config` YAML file, then defaults.\n",
            "| setting | environment variable | default | meaning |", "|---|---|---|---|"]
    for name, field in cls.model_fields.items():
        default = "(host name)" if name == "identity" else field.get_default(call_default_factory=True)
        rows.append(f"| `{name}` | `{prefix}{name.upper()}` | `{default!r}` | {field.description or ''} |")
    return "\n".join(rows) + "\n"


def render() -> str:
    return ("# Configuration reference\n\nGenerated from `dynpart/settings.py` by "
            "`python -m dynpart.settings_doc`; a test checks it is current.\n\n"
            + _table(PlannerSettings, "dynpart planner run") + "\n" + _table(AgentSettings, "dynpart agent run"))


if __name__ == "__main__":
    print(render(), end="")
