"""A comm that keeps what a widget publishes, as anywidget's and ipywidgets' own tests use."""

from __future__ import annotations

from typing import Any

from comm.base_comm import BaseComm


class RecordingComm(BaseComm):
    """Keeps every message the widget publishes to the frontend."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, dict, list]] = []
        super().__init__(target_name="jupyter.widget", primary=False)

    def publish_msg(self, msg_type, data=None, metadata=None, buffers=None, **keys):
        self.sent.append((msg_type, data, list(buffers or [])))


def attach(widget: Any) -> RecordingComm:
    comm = RecordingComm()
    widget.comm = comm
    return comm


def invoke(widget: Any, name: str, msg: dict, *, msg_id: str = "r1", only: bool = False) -> tuple[dict, list]:
    """Call a widget command exactly as the views' ESM does (anywidget's command protocol) and
    read the reply; ``only``: the reply must be the one message the widget sent."""
    comm = attach(widget)
    request = {"id": msg_id, "kind": "anywidget-command", "name": name, "msg": msg}
    from_frontend(widget, {"method": "custom", "content": request})
    if only:
        assert len(comm.sent) == 1
    msg_type, data, buffers = comm.sent[-1]
    assert msg_type == "comm_msg" and data["method"] == "custom"
    content = data["content"]
    assert content["id"] == msg_id and content["kind"] == "anywidget-command-response"
    return content["response"], buffers


def from_frontend(widget: Any, data: dict, buffers=()) -> None:
    widget._handle_msg({"content": {"data": data}, "buffers": list(buffers)})
