"""`specd start|stop|restart|status|load|unload|config|install-service|uninstall-service`.

Exit codes follow systemctl: 0 ok, 1 error, 3 not running (`status`, `stop`).
`start` takes the options of `serve`; options not given come from `specd config`
(config.toml, overridden by SPECD_<KEY> environment variables).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from specd.daemon.control import config as config_mod
from specd.daemon.control import service_control as sc
from specd.daemon.training.progress import duration

EXIT_OK, EXIT_ERROR, EXIT_NOT_RUNNING = 0, 1, 3
AddArgs = Callable[[argparse.ArgumentParser], None]
# options of `start`/`restart` that are not passed on to `serve`
_PATH_DESTS = ("model", "draft", "socket", "history_file")


def _err(msg: str) -> int:
    print(f"specd: error: {msg}", file=sys.stderr)
    return EXIT_ERROR


def _serve_actions(p: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in p._actions if a.option_strings and a.dest != "help"]


def _absolute(dest: str, value: str) -> str:
    """Relative paths would break: the daemon runs in the state dir."""
    if dest == "socket" or Path(value).exists():
        return str(Path(value).expanduser().absolute())
    return value


_UNSET = object()  # the default of start/restart's serve options: "not given"


def _argv_for(args: argparse.Namespace, actions: list[argparse.Action],
              cfg: dict[str, Any] | None) -> list[str]:
    """`serve` argv for the options given in `args` (even at serve's default value: they
    win over the config), then, with `cfg`, the config's values that differ from
    serve's defaults."""
    out: list[str] = []
    for a in actions:
        default = getattr(a, "serve_default", a.default)
        value = getattr(args, a.dest, _UNSET)
        if value is _UNSET or value is None and isinstance(a, argparse._AppendAction):
            if cfg is None or a.dest not in cfg or cfg[a.dest] == default:
                continue
            value = cfg[a.dest]
        if value is None:
            continue
        opt = max(a.option_strings, key=len)
        if isinstance(a, argparse.BooleanOptionalAction):
            yes, no = sorted(a.option_strings, key=len)
            out.append(yes if value else no)
        elif a.nargs == 0:  # store_true / store_false: given means its constant
            if value == a.const:
                out.append(opt)
        elif isinstance(value, list):
            for v in value:
                out += [opt, _absolute(a.dest, str(v)) if a.dest in _PATH_DESTS else str(v)]
        else:
            v = _absolute(a.dest, str(value)) if a.dest in _PATH_DESTS else str(value)
            out += [opt, v]
    return out


def _start_args(p: argparse.ArgumentParser, add_model_args: AddArgs,
                add_sampling_args: AddArgs, add_serve_args: AddArgs) -> list[argparse.Action]:
    """serve's options on `p`, defaulting to "not given" (their serve defaults are kept
    in `serve_default`), so that one typed at its default value still wins over the
    config; returns them."""
    add_model_args(p)
    add_sampling_args(p)
    add_serve_args(p)
    actions = _serve_actions(p)
    for a in actions:
        a.serve_default = a.default  # type: ignore[attr-defined]
        a.default = None if isinstance(a, argparse._AppendAction) else _UNSET
    p.add_argument("--wait", dest="wait_s", type=float, default=600.0, metavar="SECONDS",
                   help="how long to wait for the daemon to answer (default 600)")
    return actions


def add_service_commands(sub: argparse._SubParsersAction, add_model_args: AddArgs,
                         add_sampling_args: AddArgs, add_serve_args: AddArgs) -> None:
    """Add the service subcommands to `specd`'s subparsers."""
    st = sub.add_parser("start", help="start the daemon in the background",
                        description="Start the daemon in the background (log and pid file in "
                        "the state dir). Options not given come from `specd config`.")
    st_actions = _start_args(st, add_model_args, add_sampling_args, add_serve_args)
    st.add_argument("--foreground", action="store_true",
                    help="run in the foreground, as `serve` with the config (for services)")
    st.set_defaults(func=lambda a: _start(a, st_actions))

    rs = sub.add_parser("restart", help="stop the daemon, then start it",
                        description="Restart the daemon: the options of its last `start` "
                        "(unless new ones are given) with the current `specd config`.")
    rs_actions = _start_args(rs, add_model_args, add_sampling_args, add_serve_args)
    rs.add_argument("--timeout", type=float, default=30.0, metavar="SECONDS",
                    help="SIGKILL the old daemon after this long (default 30)")
    rs.set_defaults(func=lambda a: _restart(a, rs, rs_actions))

    sp = sub.add_parser("stop", help="stop the background daemon (exit 3: not running)")
    sp.add_argument("--timeout", type=float, default=30.0, metavar="SECONDS",
                    help="SIGKILL after this long (default 30)")
    sp.set_defaults(func=_stop)

    ss = sub.add_parser("status", help="daemon state, models, slots, speed (exit 3: not "
                        "running)")
    ss.add_argument("--json", action="store_true", help="machine-readable")
    ss.set_defaults(func=_status)

    for verb, what in (("load", "load the running daemon's model now (it unloads once "
                                "idle for its --keep-alive)"),
                       ("unload", "unload the running daemon's model once nothing runs: its "
                                  "memory back to the system; the next request reloads it")):
        lu = sub.add_parser(verb, help=f"{what} (exit 3: not running)")
        lu.add_argument("model", nargs="?", default="",
                        help="which of its models (serve --models), by name (default: -m's)")
        lu.set_defaults(func=lambda a, verb=verb: _load_or_unload(verb, a.model))

    ca = sub.add_parser("cache", help="the running daemon's caches of your requests")
    casub = ca.add_subparsers(dest="cache_command", metavar="ACTION", required=True)
    cc = casub.add_parser("clear", help="forget your history (what history speculation "
                          "drafts from) and your cached prompts (exit 3: not running)")
    cc.set_defaults(func=lambda a: _clear_cache())

    cf = sub.add_parser("config", help="show or change the defaults for `start` and services")
    csub = cf.add_subparsers(dest="config_command", metavar="ACTION")
    cshow = csub.add_parser("show", help="the effective values (default action)")
    cshow.add_argument("--json", action="store_true")
    csub.add_parser("path", help="print the config file's path")
    cset = csub.add_parser("set", help="set KEY to VALUE (" + ", ".join(config_mod.KEYS)
                           + "; a list key's entries comma-separated)")
    cset.add_argument("key", choices=list(config_mod.KEYS), metavar="KEY")
    cset.add_argument("value", metavar="VALUE")
    cun = csub.add_parser("unset", help="remove KEY from the file")
    cun.add_argument("key", choices=list(config_mod.KEYS), metavar="KEY")
    cf.set_defaults(func=_config, json=False)

    ins = sub.add_parser("install-service", help="run specd as a user service at login "
                         "(systemd / launchd / Windows Startup)")
    ins.add_argument("--no-enable", action="store_true",
                     help="only write the file; print the commands that enable it")
    ins.add_argument("--print", dest="print_only", action="store_true",
                     help="print the service file, change nothing")
    ins.set_defaults(func=_install)

    un = sub.add_parser("uninstall-service", help="remove the user service")
    un.add_argument("--no-disable", action="store_true",
                    help="only remove the file; do not run the service manager")
    un.set_defaults(func=_uninstall)


# -- start / stop / restart ---------------------------------------------------------------
def _progress(elapsed: float, state: dict[str, float]) -> None:
    if sys.stderr.isatty() and elapsed - state.get("last", -10.0) >= 5.0:
        state["last"] = elapsed
        print(f"specd: waiting for the daemon ({elapsed:.0f} s; log {sc.log_path()})",
              file=sys.stderr)


def _launch(argv: list[str], args: argparse.Namespace) -> int:
    shown: dict[str, float] = {}
    try:
        pid = sc.start(argv, verbose=bool(getattr(args, "verbose", False)),
                       timeout=args.wait_s, cwd=sc.state_dir(),
                       on_wait=lambda e: _progress(e, shown))
    except KeyboardInterrupt:  # the daemon goes on loading: say so
        bg = sc.running_pid()
        print(f"\nspecd goes on starting in the background (pid {bg}); `specd status` to "
              "see it, `specd stop` to stop it" if bg else "\nspecd start interrupted",
              file=sys.stderr)
        return 130
    st = sc.status()
    where = st.socket or st.url or "?"
    what = ""
    if st.snapshot is not None:
        s = st.snapshot
        what = f": {s.target}" + (f" + draft {s.draft}" if s.draft else "") + \
            f", spec {s.spec_type}"
    print(f"specd started (pid {pid}) on {where}{what}")
    return EXIT_OK


def _start(args: argparse.Namespace, actions: list[argparse.Action]) -> int:
    try:
        cfg = config_mod.load_config()
    except config_mod.ConfigError as exc:
        return _err(str(exc))
    argv = _argv_for(args, actions, cfg)
    if args.foreground:
        cmd = sc.serve_command(argv, bool(getattr(args, "verbose", False)))
        sys.stdout.flush()
        sys.stderr.flush()
        if sys.platform == "win32":
            import subprocess

            return subprocess.call(cmd)
        os.execv(cmd[0], cmd)
    try:
        return _launch_with_cli(argv, _argv_for(args, actions, None), args)
    except sc.ServiceError as exc:
        return _err(str(exc))


def _restart(args: argparse.Namespace, parser: argparse.ArgumentParser,
             actions: list[argparse.Action]) -> int:
    try:
        cfg = config_mod.load_config()
    except config_mod.ConfigError as exc:
        return _err(str(exc))
    explicit = _argv_for(args, actions, None)
    # read before running_pid() clears a crashed daemon's files: its options still count
    info = sc.read_info()
    if not explicit and info.get("cli_argv"):
        args = parser.parse_args(info["cli_argv"], namespace=argparse.Namespace(**vars(args)))
        explicit = list(info["cli_argv"])
    try:
        try:
            r = sc.stop(args.timeout)
            print(f"specd stopped (pid {r.pid}{', killed' if r.killed else ''})")
        except sc.NotRunning:
            pass
        return _launch_with_cli(_argv_for(args, actions, cfg), explicit, args)
    except sc.ServiceError as exc:
        return _err(str(exc))


def _launch_with_cli(argv: list[str], explicit: list[str], args: argparse.Namespace) -> int:
    code = _launch(argv, args)
    info = sc.read_info()
    if info:
        info["cli_argv"] = explicit
        sc.write_info(info)
    return code


def _stop(args: argparse.Namespace) -> int:
    try:
        r = sc.stop(args.timeout)
    except sc.NotRunning as exc:
        print(f"specd: {exc}", file=sys.stderr)
        return EXIT_NOT_RUNNING
    except sc.ServiceError as exc:
        return _err(str(exc))
    print(f"specd stopped (pid {r.pid}{', killed after SIGTERM timed out' if r.killed else ''})")
    return EXIT_OK


def _load_or_unload(verb: str, model: str) -> int:
    """POST /models/load or /models/unload to the running daemon (llama-server's router
    routes) for `model` ("": the one it started with)."""
    try:
        sc.client_for().post(f"/models/{verb}", {"model": model})
    except sc.DaemonUnavailable:
        print("specd: the daemon is not running", file=sys.stderr)
        return EXIT_NOT_RUNNING
    except (sc.DaemonError, OSError) as exc:
        return _err(str(exc))
    what = f"model {model}" if model else "model"
    print(f"{what} loaded" if verb == "load" else f"{what} unloading (once nothing runs)")
    return EXIT_OK


def _clear_cache() -> int:
    """POST /cache/clear to the running daemon: it forgets this user's history and cached
    prompts."""
    try:
        got = sc.client_for().post("/cache/clear", {})
    except sc.DaemonUnavailable:
        print("specd: the daemon is not running", file=sys.stderr)
        return EXIT_NOT_RUNNING
    except (sc.DaemonError, OSError) as exc:
        return _err(str(exc))
    print(f"cleared {got.get('history_tokens', 0)} tokens of history and "
          f"{got.get('slots', 0)} cached prompts")
    return EXIT_OK


# -- status -------------------------------------------------------------------------------
def format_status(st: sc.Status) -> str:
    if not st.running:
        return "specd is not running"
    head = "specd is running" + (f" (pid {st.pid}" if st.pid else " (not started by "
                                 "`specd start`") + (f", up {duration(time.time() - st.started)}"
                                                     if st.started else "") + ")"
    rows: list[tuple[str, str]] = []
    if st.socket:
        rows.append(("socket", st.socket))
    if st.url:
        rows.append(("http", st.url))
    if st.error:
        rows.append(("error", st.error))
    s = st.snapshot
    if s is not None:
        rows.append(("target", s.target + ("" if s.loaded else " (unloaded while idle)")))
        if len(local := s.local_models()) > 1:  # serve --models, or the store's
            rows.append(("models", ", ".join(f"{name} ({'loaded' if up else 'unloaded'})"
                                             for name, up in local)))
        if s.draft:
            rows.append(("draft", s.draft))
        rows.append(("spec type", s.spec_type))
        if "n_ctx" in s.props:
            rows.append(("n_ctx", str(s.props["n_ctx"])))
        states = ", ".join(f"{n} {k}" for k, n in sorted(s.slot_states().items()))
        rows.append(("slots", f"{len(s.slots)}" + (f" ({states})" if states else "")))
        drafted = int(s.metrics.get("specd_draft_tokens_total", 0))
        accepted = int(s.metrics.get("specd_draft_tokens_accepted_total", 0))
        if drafted:
            rows.append(("acceptance", f"{s.acceptance:.2f} tokens/round "
                         f"({accepted}/{drafted} drafted tokens accepted)"))
        rows.append(("speed", f"{s.tokens_per_second:.1f} tokens/s"))
        rows.append(("requests", str(int(s.metrics.get("specd_requests_total", 0)))))
    rows.append(("log", st.log))
    return head + "\n" + "\n".join(f"  {k + ':':11s} {v}" for k, v in rows)


def _status(args: argparse.Namespace) -> int:
    st = sc.status()
    if args.json:
        print(json.dumps(st.to_json(), indent=1))
    else:
        print(format_status(st))
    if not st.running:
        return EXIT_NOT_RUNNING
    return EXIT_ERROR if st.error else EXIT_OK


# -- config -------------------------------------------------------------------------------
def _config(args: argparse.Namespace) -> int:
    action = args.config_command or "show"
    try:
        if action == "path":
            print(config_mod.config_path())
        elif action == "set":
            print(f"{args.key} = {config_mod.coerce(args.key, args.value)!r} "
                  f"in {config_mod.set_value(args.key, args.value)}")
        elif action == "unset":
            config_mod.set_value(args.key, None)
            print(f"{args.key} removed from {config_mod.config_path()}")
        else:
            return _config_show(bool(args.json))
    except config_mod.ConfigError as exc:
        return _err(str(exc))
    return EXIT_OK


def _config_show(as_json: bool) -> int:
    file_values = config_mod.read_file()
    env = config_mod.env_overrides()
    if as_json:
        print(json.dumps({"path": str(config_mod.config_path()),
                          "values": {**file_values, **env}, "env": sorted(env)}, indent=1))
        return EXIT_OK
    print(f"# {config_mod.config_path()}"
          + ("" if config_mod.config_path().is_file() else " (not created yet)"))
    for key in config_mod.KEYS:
        if key in env:
            print(f"{key} = {env[key]!r}  # from SPECD_{key.upper()}")
        elif key in file_values:
            print(f"{key} = {file_values[key]!r}")
        else:
            print(f"# {key}: (serve's default)")
    return EXIT_OK


# -- services -----------------------------------------------------------------------------
def _templates() -> Any:
    from specd.installers import templates

    return templates


def _install(args: argparse.Namespace) -> int:
    t = _templates()
    try:
        if args.print_only:
            sf = t.render()
            print(f"# {sf.path}")
            sys.stdout.write(sf.content.decode("utf-8"))
            return EXIT_OK
        r = t.install_service(enable=not args.no_enable)
    except t.InstallError as exc:
        print(f"specd: error: {exc}; the file is {t.service_path()}; enable it with:\n  "
              + "\n  ".join(" ".join(c) for c in t.render().enable), file=sys.stderr)
        return EXIT_ERROR
    print(f"{'wrote' if r.changed else 'unchanged:'} {r.file.path}")
    if r.ran:
        print("service enabled and started")
    else:
        print("enable and start it with:\n  " + "\n  ".join(" ".join(c)
                                                          for c in r.file.enable))
    return EXIT_OK


def _uninstall(args: argparse.Namespace) -> int:
    t = _templates()
    try:
        r = t.uninstall_service(disable=not args.no_disable)
    except t.InstallError as exc:
        return _err(str(exc))
    if not r.changed:
        print(f"no service installed ({r.file.path})")
        return EXIT_OK
    print(f"removed {r.file.path}")
    if not r.ran:
        print("if it is still loaded, stop it with:\n  " + "\n  ".join(
            " ".join(c) for c in r.file.disable))
    return EXIT_OK
