"""Prefect automations for ortflow's deployments, from the file the package ships (``automations.yaml``).

* ``ortflow-zombie-runs``: a flow run whose heartbeats stop (its process was killed or its host vanished) is marked
  Crashed, which frees its deployment's concurrency slot for the next scheduled run.
* ``ortflow-run-failed``, ``ortflow-run-lost`` and ``ortflow-run-late``: a webhook (a Prefect ``Webhook`` block named
  ``ortflow-alerts``) is called when a run of an ortflow deployment fails, crashes or times out, when the zombie-run
  automation marked it Crashed, or when it is still running past its expected time.

The automations match flow runs tagged ``ortflow``: every deployment ``ortflow serve`` and ``prefect.yaml`` create.
A run that ended (any end: Completed, Skipped, Failed, ...) closes the zombie-run window; a run announces itself late
from its own process (``ortflow.flow-run.late``, at the bound kept in the Prefect Variable ``ortflow_late_after_s``),
so only runs that are still running are ever late.
"""

from __future__ import annotations

from pathlib import Path
from string import Template
from urllib.parse import urlsplit
from uuid import UUID

import yaml

from ortflow.protocol import LATE_AFTER_VARIABLE

AUTOMATIONS_FILE = Path(__file__).with_name("automations.yaml")
WEBHOOK_BLOCK = "ortflow-alerts"
ZOMBIE = "ortflow-zombie-runs"
#: Seconds between flow-run heartbeats in ortflow's deployments (Prefect's minimum is 30).
HEARTBEAT_S = 30
#: The shortest late bound taken (a shorter one calls every run late).
SHORTEST_WINDOW_S = 10
#: A placeholder id for the file's ids not known yet (the alert automations are left out without a webhook).
_NO_ID = UUID(int=0)


def render(webhook_block_id: UUID | None, late_after_s: int, zombie_after_s: int,
           zombie_automation_id: UUID | None = None) -> list[dict]:
    """The automations of the shipped file with their parameters filled in (Prefect's automation schema): the
    zombie-run automation alone without a webhook, else all of them (``ortflow-run-lost`` names the zombie-run
    automation by id: ``zombie_automation_id``)."""
    text = Template(AUTOMATIONS_FILE.read_text()).substitute(
        webhook_block_id=webhook_block_id or _NO_ID, late_after_s=int(late_after_s),
        zombie_after_s=int(zombie_after_s), zombie_automation_id=zombie_automation_id or _NO_ID)
    specs = yaml.safe_load(text)["automations"]
    if not webhook_block_id:
        return [s for s in specs if s["name"] == ZOMBIE]
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
        ValueError: a bound is too short to mean anything, or the webhook is not an http(s) URL.
    """
    from prefect.blocks.webhook import Webhook
    from prefect.client.orchestration import get_client
    from prefect.events.schemas.automations import AutomationCore

    if zombie_after_s < 2 * HEARTBEAT_S:
        raise ValueError(f"--zombie-after {zombie_after_s}: give at least {2 * HEARTBEAT_S} s (two heartbeats)")
    if late_after_s < SHORTEST_WINDOW_S:
        raise ValueError(f"--late-after {late_after_s}: give at least {SHORTEST_WINDOW_S} s")
    if webhook_url is not None:
        parts = urlsplit(webhook_url)
        if parts.scheme not in ("http", "https") or not parts.netloc:  # Prefect saves any text; alerts never come
            raise ValueError(f"--webhook {webhook_url}: give an http:// or https:// URL "
                             "(e.g. https://hooks.example.com/ortflow)")
    block_id = None
    if webhook_url:
        # An alert endpoint is often inside the network (a chat bridge, a pager gateway): private addresses are fine.
        block_id = Webhook(method="POST", url=webhook_url, headers={"Content-Type": "application/json"},
                           allow_private_urls=True).save(WEBHOOK_BLOCK, overwrite=True)
    with get_client(sync_client=True) as client:
        names = [spec["name"] for spec in render(block_id, late_after_s, zombie_after_s)]
        for name in (spec["name"] for spec in render(_NO_ID, late_after_s, zombie_after_s)):  # every one shipped
            for existing in client.read_automations_by_name(name):
                client.delete_automation(existing.id)
        # The zombie-run automation first: the alert on its accepted state changes names it by id.
        zombie_id = client.create_automation(AutomationCore.model_validate(
            render(None, late_after_s, zombie_after_s)[0]))
        for spec in render(block_id, late_after_s, zombie_after_s, zombie_id):
            if spec["name"] != ZOMBIE:
                client.create_automation(AutomationCore.model_validate(spec))
        _set_late_after(client, late_after_s if block_id else None)
    return names


def _set_late_after(client, late_after_s: int | None) -> None:
    """Runs read the late bound from a Prefect Variable and announce themselves late (``ortflow.flow-run.late``);
    without the late alert (no webhook) the variable is removed and no run announces anything."""
    from prefect.client.schemas.actions import VariableCreate, VariableUpdate

    if late_after_s is None:
        if client.read_variable_by_name(LATE_AFTER_VARIABLE) is not None:
            client.delete_variable_by_name(LATE_AFTER_VARIABLE)
    elif client.read_variable_by_name(LATE_AFTER_VARIABLE) is None:
        client.create_variable(VariableCreate(name=LATE_AFTER_VARIABLE, value=int(late_after_s)))
    else:
        client.update_variable(VariableUpdate(name=LATE_AFTER_VARIABLE, value=int(late_after_s)))
