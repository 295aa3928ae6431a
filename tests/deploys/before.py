"""The ``orders`` agent as first deployed: two tools."""

from __future__ import annotations

from ratchet import Agent, register_agent, tool

PROMPT = "You answer questions about orders (first deploy)."


@tool(idempotent=True)
def lookup_order(order: str) -> str:
    """Look an order up by its number."""
    return f"order {order}: shipped"


@tool
def cancel_order(order: str) -> str:
    """Cancel an order by its number."""
    return f"order {order}: cancelled"


register_agent(Agent(name="orders", system_prompt=PROMPT, tools=("lookup_order", "cancel_order")))
