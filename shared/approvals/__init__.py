"""Approvals: a person's decision on a tool call that waits for one (approve, edit or
reject), made exactly once whoever asks and however often, and the deadline that decides
when nobody did."""
