"""What the tray shows for a daemon snapshot: pure logic, no GUI (tested without a display).

`view(observation)` takes what the poller saw: None (nothing answers: the daemon is down),
`Starting` (nothing answers yet, but the daemon `specd start` launched is alive: loading
its models), a `DaemonSnapshot` (/props, /slots, /metrics), or an exception (it answers,
but badly), and returns the icon state, the tooltip and the menu items.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from specd.daemon.control.service_control import DaemonSnapshot


class IconState(StrEnum):
    DOWN = "down"  # no daemon
    STARTING = "starting"  # launched, loading its models, not answering yet
    IDLE = "idle"  # up, no slot busy
    GENERATING = "generating"  # a slot is in prefill or generating
    ERROR = "error"  # something answers but not properly


@dataclass(frozen=True)
class MenuItem:
    text: str
    action: str | None = None  # None: an information line (disabled)
    enabled: bool = True
    default: bool = False  # the action of a click on the icon


SEPARATOR = MenuItem("-", None, enabled=False)
UNLOAD_ONE = "unload:"  # an action's prefix: unload the model named after it


@dataclass
class TrayView:
    state: IconState
    title: str  # the tooltip
    items: list[MenuItem] = field(default_factory=list)

    def actions(self) -> list[str]:
        return [i.action for i in self.items if i.action and i.enabled]


@dataclass(frozen=True)
class Starting:
    pid: int


Observation = DaemonSnapshot | Starting | BaseException | None


def _info_lines(s: DaemonSnapshot) -> list[MenuItem]:
    lines = [MenuItem(f"Target: {s.target}" + ("" if s.loaded else " (unloaded while idle)"),
                      enabled=False),
             MenuItem(f"Draft: {s.draft}" if s.draft else "Draft: none", enabled=False),
             MenuItem(f"Speculation: {s.spec_type}", enabled=False),
             *(MenuItem(f"Model: {name}" + ("" if up else " (unloaded)"), enabled=False)
               for name, up in s.local_models()[1:])]
    states = s.slot_states()
    busy = states.get("generating", 0) + states.get("prefill", 0)
    lines.append(MenuItem(f"Slots: {busy}/{len(s.slots)} busy", enabled=False))
    lines.append(MenuItem(f"Speed: {s.tokens_per_second:.1f} tokens/s", enabled=False))
    if s.metrics.get("specd_draft_tokens_total", 0) > 0:
        lines.append(MenuItem(f"Acceptance: {s.acceptance:.2f} tokens/round", enabled=False))
    else:
        lines.append(MenuItem("Acceptance: -", enabled=False))
    return lines


def _menu(head: list[MenuItem], *, start: bool, stop: bool, restart: bool,
          default: str, loaded: bool | None = None,
          others: tuple[str, ...] = ()) -> list[MenuItem]:
    """The information lines, the controls this state allows, then the common items;
    `default` is the action a click on the icon runs; `loaded`: whether the running
    daemon's model is loaded (None: no daemon answering); `others`: its other models
    loaded now (serve --models), each offered for unloading."""
    def item(text: str, action: str, enabled: bool = True) -> MenuItem:
        return MenuItem(text, action, enabled=enabled, default=action == default)

    model = ([] if loaded is None else
             [item("Unload model", "unload") if loaded else item("Load model", "load")])
    model += [item(f"Unload {name}", f"{UNLOAD_ONE}{name}") for name in others]
    return [*head, SEPARATOR, item("Start", "start", start), item("Stop", "stop", stop),
            item("Restart", "restart", restart), *model, SEPARATOR,
            item("Open log", "open_log"),
            item("Open config", "open_config"), SEPARATOR, item("Quit tray", "quit")]


def view(obs: Observation) -> TrayView:
    if obs is None:
        return TrayView(IconState.DOWN, "specd: not running", _menu(
            [MenuItem("specd is not running", enabled=False)],
            start=True, stop=False, restart=False, default="start"))
    if isinstance(obs, Starting):
        return TrayView(IconState.STARTING, f"specd: starting (pid {obs.pid})", _menu(
            [MenuItem(f"specd is starting (pid {obs.pid}): loading models", enabled=False)],
            start=False, stop=True, restart=False, default="open_log"))
    if isinstance(obs, BaseException):
        msg = str(obs).splitlines()[0][:80] if str(obs) else type(obs).__name__
        return TrayView(IconState.ERROR, f"specd: error: {msg}", _menu(
            [MenuItem(f"Error: {msg}", enabled=False)],
            start=False, stop=True, restart=True, default="restart"))
    state = IconState.GENERATING if obs.busy else IconState.IDLE
    title = f"specd: {state.value} - {obs.target}"
    if obs.draft:
        title += f" + {obs.draft}"
    if state is IconState.GENERATING or obs.tokens_per_second > 0:
        title += f", {obs.tokens_per_second:.1f} tok/s"
    if obs.metrics.get("specd_draft_tokens_total", 0) > 0:
        title += f", acceptance {obs.acceptance:.2f}"
    others = tuple(name for name, up in obs.local_models()[1:] if up)
    return TrayView(state, title, _menu(_info_lines(obs), start=False, stop=True,
                                        restart=True, default="open_log",
                                        loaded=obs.loaded, others=others))
