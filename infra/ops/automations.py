"""Server-side alerts: install infra/deploy/automations.yaml on a Prefect server, with the notification block's
id filled in (a killed run that stops heartbeating is marked Crashed; Failed/Crashed runs notify)."""

from __future__ import annotations

from pathlib import Path

import yaml

from infra.errors import ConfigError

AUTOMATION_BLOCK_PLACEHOLDER = "${LATENTFORGE_NOTIFY_BLOCK_ID}"


def render_automations(text: str, block_document_id: str) -> str:
    """infra/deploy/automations.yaml with the notification block's id filled in (the file format wants an id,
    not a name: `send-notification` takes `block_document_id: UUID`)."""
    if AUTOMATION_BLOCK_PLACEHOLDER not in text:
        raise ConfigError(f"no {AUTOMATION_BLOCK_PLACEHOLDER} in the automations file")
    return text.replace(AUTOMATION_BLOCK_PLACEHOLDER, block_document_id)


def install_automations(api_url: str, block: str, path: Path) -> list[tuple[str, str]]:
    """Create the automations of `path` on the server, notifying through the block `TYPE-SLUG/NAME`
    (e.g. ``custom-webhook/latentforge-alerts``); an automation of the same name is replaced. [(name, id)]"""
    from prefect.client.orchestration import get_client  # noqa: PLC0415 - heavy: Prefect; `server status` stays light
    from prefect.events.schemas.automations import AutomationCore  # noqa: PLC0415
    from prefect.settings import PREFECT_API_URL, temporary_settings  # noqa: PLC0415

    block_type, _, name = block.partition("/")
    if not name:
        raise ConfigError(f"--block takes TYPE-SLUG/NAME (e.g. custom-webhook/latentforge-alerts), not {block!r}")
    created = []
    with temporary_settings({PREFECT_API_URL: api_url}), get_client(sync_client=True) as client:
        block_id = str(client.read_block_document_by_name(name, block_type).id)
        data = yaml.safe_load(render_automations(Path(path).read_text(), block_id))
        for item in data["automations"] if isinstance(data, dict) else data:
            automation = AutomationCore.model_validate(item)
            for old in client.read_automations_by_name(automation.name):
                client.delete_automation(old.id)
            created.append((automation.name, str(client.create_automation(automation))))
    return created
