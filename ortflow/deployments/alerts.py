"""Prefect automations for ortflow's deployments, from the file the package ships (``automations.yaml``).

* ``ortflow-zombie-runs``: a flow run whose heartbeats stop (its process was killed or its host vanished) is marked
  Crashed, which frees its deployment's concurrency slot for the next scheduled run.
* ``ortflow-run-failed`` and ``ortflow-run-late``: a webhook (a Prefect ``Webhook`` block named ``ortflow-alerts``)
  is called when a run of an ortflow deployment fails, crashes or times out, or is still running past its expected
  time.

The automations match flow runs tagged ``ortflow``: every deployment ``ortflow serve`` and ``prefect.yaml`` create.
"""

from __future__ import annotations

from pathlib import Path
from string import Template
from uuid import UUID

import yaml

AUTOMATIONS_FILE = Path(__file__).with_name("automations.yaml")
WEBHOOK_BLOCK = "ortflow-alerts"
ZOMBIE = "ortflow-zombie-runs"
#: Seconds between flow-run heartbeats in ortflow's deployments (Prefect's minimum is 30).
HEARTBEAT_S = 30
#: A placeholder block id for the file when no webhook is installed (the alert automations are left out then).
_NO_BLOCK = UUID(int=0)


def render(webhook_block_id: UUID | None, late_after_s: int, zombie_after_s: int) -> list[dict]:
    """The automations of the shipped file with their parameters filled in (Prefect's automation schema)."""
    text = Template(AUTOMATIONS_FILE.read_text()).substitute(
        webhook_block_id=webhook_block_id or _NO_BLOCK, late_after_s=int(late_after_s),
        zombie_after_s=int(zombie_after_s))
    specs = yaml.safe_load(text)["automations"]
    if not webhook_block_id:
        return [s for s in specs if s["name"] == ZOMBIE]
    zombie = next(s for s in specs if s["name"] == ZOMBIE)
    zombie["actions"].append({  # a crash the zombie automation found is alerted too
        "type": "call-webhook", "block_document_id": str(webhook_block_id),
        "payload": '{"alert": "ortflow run Crashed (no heartbeat for ' + str(int(zombie_after_s)) + ' s)", '
                   '"flow_run": "{{ flow_run.name }}", "flow_run_id": "{{ flow_run.id }}", '
                   '"deployment": "{{ deployment.name }}"}',
    })
    return specs


def install(webhook_url: str | None = None, late_after_s: int = 6 * 3600, zombie_after_s: int = 3 * HEARTBEAT_S
            ) -> list[str]:
    """Create (or replace) the automations on the configured Prefect server.

    Args:
        webhook_url: Where alerts are POSTed (JSON); None installs the zombie-run automation only.
        late_after_s: A run still running this many seconds after it started is late.
        zombie_after_s: A run without a heartbeat for this long is marked Crashed (at least twice the heartbeat).

    Returns:
        The names of the automations installed.

    Raises:
        ValueError: a bound is too short to mean anything.
    """
    from prefect.blocks.webhook import Webhook
    from prefect.client.orchestration import get_client
    from prefect.events.schemas.automations import AutomationCore

    if zombie_after_s < 2 * HEARTBEAT_S:
        raise ValueError(f"--zombie-after {zombie_after_s}: give at least {2 * HEARTBEAT_S} s (two heartbeats)")
    if late_after_s < 1:
        raise ValueError(f"--late-after {late_after_s}: give a number of seconds >= 1")
    block_id = None
    if webhook_url:
        # An alert endpoint is often inside the network (a chat bridge, a pager gateway): private addresses are fine.
        block_id = Webhook(method="POST", url=webhook_url, headers={"Content-Type": "application/json"},
                           allow_private_urls=True).save(WEBHOOK_BLOCK, overwrite=True)
    specs = render(block_id, late_after_s, zombie_after_s)
    with get_client(sync_client=True) as client:
        for spec in specs:
            for existing in client.read_automations_by_name(spec["name"]):
                client.delete_automation(existing.id)
            client.create_automation(AutomationCore.model_validate(spec))
    return [spec["name"] for spec in specs]
