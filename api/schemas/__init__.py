"""The HTTP API's request and response bodies, one module per resource: pydantic classes,
never ORM models (a task's own view, ``TaskView``, is shared with the webhooks' documents and
lives in ``shared.views``)."""
