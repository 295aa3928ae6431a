"""The ``orders`` agent as deployed next: a new system prompt, ``lookup_order`` described anew,
and ``cancel_order`` gone."""

from __future__ import annotations

from ratchet import Agent, register_agent, tool

PROMPT = "You answer questions about orders (second deploy)."


@tool(idempotent=True)
def lookup_order(order: str) -> str:
    """Find an order by its number, and say where it is."""
    return f"order {order}: delivered"


register_agent(Agent(name="orders", system_prompt=PROMPT, tools=("lookup_order",)))
