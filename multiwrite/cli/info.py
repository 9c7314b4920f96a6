"""`multiwrite info`: versions, devices, and every registered backend with its status."""

from __future__ import annotations

import argparse
import os
import warnings
from typing import TYPE_CHECKING

from multiwrite.cli.args import add_subcommand

if TYPE_CHECKING:
    import torch


def add_parser(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    """Register `info` on the `multiwrite` command's subparsers."""
    p = add_subcommand(
        sub, common, "info", cmd_info, help="versions, devices and every registered backend with its status"
    )
    p.add_argument("-v", "--verbose", action="store_true", help="also print each failed plugin's traceback")


def cmd_info(args: argparse.Namespace) -> int:
    """Run `multiwrite info`; returns 0.

    Per device, the backend dispatch would pick is marked selected; when `$MULTIWRITE_BACKEND` forces one
    that cannot run there, a line says so (with its reasons) and nothing is marked.
    """
    import torch

    from multiwrite.environment import environment
    from multiwrite.plugins.dispatch import BACKEND_ENV

    cpu = torch.device("cpu")
    env = environment(cpu)
    print("multiwrite info")
    print(
        f"  versions  multiwrite {env['multiwrite']}, torch {env['torch']}, triton {env['triton']}, "
        f"numpy {env['numpy']}, python {env['python']}"
    )
    hip = getattr(torch.version, "hip", None)
    devices = [cpu]
    print(f"  cpu       {env['device_name']} ({env['torch_threads']} torch threads)")
    if torch.cuda.is_available():
        kind = f"ROCm/HIP {hip}" if hip else f"CUDA {torch.version.cuda}"
        for i in range(torch.cuda.device_count()):
            devices.append(torch.device("cuda", i))
            print(f"  cuda:{i}    {torch.cuda.get_device_name(i)} ({kind})")
    else:
        build = f"HIP {hip}" if hip else f"CUDA {torch.version.cuda}" if torch.version.cuda else "CPU only"
        print(f"  cuda      no device (torch build: {build})")
    if len(devices) == 1:
        devices.append(torch.device("cuda"))  # say why the GPU backends cannot run here
    forced = os.environ.get(BACKEND_ENV) or None
    with warnings.catch_warnings(record=True) as caught:  # said once, after the listing, not inside it
        warnings.simplefilter("always")
        _list_backends(args, devices, forced)
    notes = list(dict.fromkeys(str(w.message) for w in caught))
    if notes:
        print("warnings:")
        for note in notes:
            print(f"  {note}")
    return 0


def _list_backends(args: argparse.Namespace, devices: list[torch.device], forced: str | None) -> None:
    from multiwrite.errors import BackendUnavailableError
    from multiwrite.plugins.dispatch import BACKEND_ENV, available_backends, select_backend

    for device in devices[:2]:
        print(f"backends for {device}:")
        statuses = available_backends(device)
        try:
            chosen = select_backend(device)  # exactly what dispatch does, $MULTIWRITE_BACKEND included
        except BackendUnavailableError:
            chosen = None
        for s in statuses:
            state = "available" if s.available else "unavailable: " + "; ".join(s.reasons)
            mark = ""
            if chosen is not None and s.name == chosen.NAME and s.taken_by is None:  # names are unique
                mark = f"  <- selected (forced by ${BACKEND_ENV})" if forced else "  <- selected"
            priority = f"{s.priority:>4}" if s.backend is not None else "   -"
            dist = f"{s.distribution} {s.version}" if s.distribution else "-"
            print(f"  {s.name:<13} {dist:<22} priority {priority}  {state}{mark}")
            if getattr(args, "verbose", False) and s.traceback and device == devices[0]:
                print("    " + s.traceback.rstrip().replace("\n", "\n    "))
        if forced and chosen is None:
            owner = next((s for s in statuses if s.name == forced and s.taken_by is None), None)
            if owner is None:
                names = ", ".join(sorted({s.name for s in statuses}))
                why = f"no backend of that name is registered (registered: {names})"
            else:
                why = "; ".join(owner.reasons)
            print(f"  forced by ${BACKEND_ENV}={forced}: cannot run: {why}")
