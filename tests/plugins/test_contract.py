"""What the host reads from a backend is checked where it is read (`multiwrite.plugins.checked`): a declaration of the
wrong type or one that raises, or a method result of the wrong type, sets THAT backend aside with a reason naming its
plugin, the backend, the attribute and the value found, and every other backend keeps working. A plugin calling back
into the host from code the host runs for a listing is refused, naming the plugin, instead of recursing.

Plugins are registered in this process through the public plugin manager, as in test_dispatch.py."""

from __future__ import annotations

import pytest
import torch

from multiwrite import (
    Backend,
    BackendUnavailableError,
    BlockTables,
    FusedStagedWriter,
    StagedWriteTensor,
    TablesPlan,
    available_backends,
    get_plugin_manager,
    hookimpl,
    select_backend,
)
from multiwrite.plugins.checked import BackendContractError, forget_set_aside
from tests.conftest import CPU_DEFAULT

#: These tests are about choosing a backend: a forced one (tox -e cuda) must not leak in.
pytestmark = pytest.mark.usefixtures("auto_selection")


@pytest.fixture(autouse=True)
def _forget_set_aside():
    """A backend set aside stays aside for the process (until `reload_plugins`): forget it after each test."""
    yield
    forget_set_aside()


class Good(Backend):
    """A valid CPU backend of a high priority, applying through torch-cpu."""

    NAME = "good"
    PRIORITY = 60
    SUPPORTED_DEVICE_TYPES = frozenset({"cpu"})

    def apply(self, batches):
        select_backend("cpu", "torch-cpu").apply(batches)


@pytest.fixture
def register():
    """`register(name, *backends)`: a plugin providing `backends`, unregistered after the test."""
    pm = get_plugin_manager()
    registered = []

    def add(name: str, *backends: Backend) -> None:
        class Plugin:
            @hookimpl
            def multiwrite_backends(self):
                return list(backends)

        plugin = Plugin()
        pm.register(plugin, name=name)
        registered.append(plugin)

    yield add
    for plugin in registered:
        if pm.is_registered(plugin):
            pm.unregister(plugin)


def _named(name: str, device: str = "cpu"):
    return [s for s in available_backends(device) if s.name == name]


def _bad(attr: str, value, name: str = "bad") -> Backend:
    """A `Good` whose class attribute `attr` is `value` (a property when `value` is an exception: it raises)."""
    attrs = {"NAME": name, "PRIORITY": 70}
    attrs[attr] = property(lambda self: (_ for _ in ()).throw(value)) if isinstance(value, Exception) else value
    return type("Bad", (Good,), attrs)()


QUAL = f"{__name__}.Bad"
#: attribute -> (its bad value, the reason the backend is set aside with, after "backend 'bad' (...Bad): ")
DECLARATIONS = {
    "PRIORITY": ("high", "PRIORITY='high' (a str) is not an int (allowed: an int, e.g. 50 to 90 for a device no "
                         "built-in serves, above 100 to override a built-in)"),
    "PRIORITY-raises": (RuntimeError("no priority today"), "reading PRIORITY raised RuntimeError: no priority today"),
    "PRIORITY-bool": (True, "PRIORITY=True (a bool) is not an int"),
    "SUPPORTED_DEVICE_TYPES": ("cpu", "SUPPORTED_DEVICE_TYPES='cpu' (a str) is not a set (allowed: a frozenset of "
                                      "torch device type names, e.g. frozenset({'cpu'}))"),
    "SUPPORTED_DTYPES": (frozenset({"int32"}), "SUPPORTED_DTYPES=frozenset({'int32'}) (a frozenset) holds 'int32' "
                                               "(a str) (allowed: a frozenset of torch dtypes, of int32, int64, "
                                               "float32)"),
}  # fmt: skip


@pytest.mark.parametrize("key", sorted(DECLARATIONS))
def test_a_bad_declaration_sets_that_backend_aside_and_the_others_keep_working(register, key):
    value, reason = DECLARATIONS[key]
    register("bad-plugin", _bad(key.split("-")[0], value))
    register("good-plugin", good := Good())
    (s,) = _named("bad")
    assert s.backend is None and not s.available
    assert s.reasons[0].startswith(f"set aside (plugin 'bad-plugin'): backend 'bad' ({QUAL}): {reason}"), s.reasons
    assert select_backend("cpu") is good  # the good plugin, priority 60, still wins over the built-ins
    assert select_backend("cpu", "torch-cpu").NAME == "torch-cpu"
    with pytest.raises(BackendUnavailableError, match=r"backend 'bad' was forced but cannot run .*: set aside"):
        select_backend("cpu", "bad")
    with pytest.raises(BackendUnavailableError) as info:
        select_backend("meta")  # the "no backend" listing names it with its reason
    assert f"  - bad: set aside (plugin 'bad-plugin'): backend 'bad' ({QUAL}): {reason}" in str(info.value)


@pytest.mark.parametrize("value", [RuntimeError("which name?"), 42, ""], ids=["raises", "int", "empty"])
def test_a_backend_without_a_valid_name_is_a_reason_of_its_plugin(register, value):
    register("nameless-plugin", _bad("NAME", value), Good())
    (s,) = _named("nameless-plugin")
    found = "reading NAME raised RuntimeError: which name?" if isinstance(value, Exception) else (
        f"NAME={value!r} ({'an int' if value == 42 else 'a str'}) is not a name (allowed: a non-empty str")
    assert s.reasons[0].startswith(f"set aside: backend {QUAL}: {found}"), s.reasons
    assert select_backend("cpu").NAME == "good"  # the plugin's other backend serves


class Reasons(Good):
    NAME = "reasons"
    PRIORITY = 70
    RESULT: object = ()

    def not_supported_reasons(self, device, dtypes=()):
        return self.RESULT


@pytest.mark.parametrize(
    ("result", "reason"),
    [
        ("needs libfoo", "returned 'needs libfoo' (a str), not a list of str: return ['needs libfoo'] (or [] when it "
                         "can run)"),
        ("", "returned '' (a str), not a list of str: return [''] (or [] when it can run)"),
        (None, "returned None (a NoneType), not a list of str"),
        (["fine", 3], "returned a list holding 3 (an int), not a list of str"),
    ],
    ids=["str", "empty-str", "none", "non-str-item"],
)  # fmt: skip
def test_reasons_of_the_wrong_type_are_never_split_into_characters(register, result, reason):
    backend = Reasons()
    backend.RESULT = result
    register("reasons-plugin", backend)
    (s,) = _named("reasons")
    assert s.reasons == [f"set aside (plugin 'reasons-plugin'): backend 'reasons' ({__name__}.Reasons): "
                         f"not_supported_reasons(cpu) {reason}"]  # fmt: skip
    assert select_backend("cpu").NAME == CPU_DEFAULT
    by_hand = Reasons()  # an instance passed by hand is checked the same way
    by_hand.RESULT = result
    with pytest.raises(BackendContractError, match=r"^backend 'reasons' .*: not_supported_reasons\(cpu\) returned"):
        FusedStagedWriter("cpu", by_hand)


def test_a_tuple_of_reasons_is_accepted():
    class Tupled(Reasons):
        RESULT = ("needs libfoo",)

    with pytest.raises(BackendUnavailableError, match=r"^backend 'reasons' cannot run on cpu: needs libfoo$"):
        FusedStagedWriter("cpu", Tupled())


class Ranked(Good):
    NAME = "ranked"

    def priority(self, device):
        return "70"


def test_a_priority_method_returning_a_str_names_priority_not_not_supported_reasons(register):
    register("ranked-plugin", Ranked())
    (s,) = _named("ranked")
    assert s.reasons == [f"set aside (plugin 'ranked-plugin'): backend 'ranked' ({__name__}.Ranked): priority(cpu) "
                         "returned '70' (a str), not an int"]  # fmt: skip


class NoPlan(Good):
    NAME = "no-plan"
    PRIORITY = 80

    def plan(self, layout, arena):
        return None


class PlainGraph(Good):
    NAME = "plain-graph"

    def graph_plan(self, layout, arena):
        return TablesPlan(self, layout, arena)  # not a GraphPlan


class BadLender(Good):
    NAME = "bad-lender"
    PRIORITY = 80

    def staging_buffers(self, device, np_dtype):
        return "pinned memory"


def test_a_plan_of_the_wrong_type_is_refused_at_construction_and_the_next_tables_select_another(register):
    register("no-plan-plugin", NoPlan())
    with pytest.raises(BackendContractError) as info:
        BlockTables([16], 2, [4], "cpu")
    assert str(info.value).startswith(f"backend 'no-plan' ({__name__}.NoPlan): plan() returned None (a NoneType), "
                                      "not a TablesPlan. The backend is set aside")  # fmt: skip
    (s,) = _named("no-plan")
    assert s.reasons == [f"set aside (plugin 'no-plan-plugin'): backend 'no-plan' ({__name__}.NoPlan): plan() "
                         "returned None (a NoneType), not a TablesPlan"]  # fmt: skip
    bt = BlockTables([16], 2, [4], "cpu")
    assert bt.backend.NAME == CPU_DEFAULT
    bt.append_block_ids(1, ([3, 4],), overwrite=True)
    bt.apply_staged_writes()
    assert bt[0].tensor[1].tolist() == [3, 4, 0, 0]


def test_a_graph_plan_that_is_not_a_graph_plan_names_the_backend():
    with pytest.raises(BackendContractError, match=r"^backend 'plain-graph' \(.*PlainGraph\): graph_plan\(\) returned "
                                                   r"<multiwrite.plugins.backend.TablesPlan object at .*> \(a "
                                                   r"TablesPlan\), not a GraphPlan or None"):  # fmt: skip
        BlockTables([16], 4, [4], "cpu", backend=PlainGraph(), cuda_graphs=True, max_num_batched_tokens=8)


def test_staging_buffers_of_the_wrong_type_name_the_backend_in_tables_and_in_a_writer():
    with pytest.raises(BackendContractError, match=r"^backend 'bad-lender' \(.*BadLender\): staging_buffers\(cpu, "
                                                   r"int32\) returned 'pinned memory' \(a str\), not a StagingBuffers "
                                                   "or None"):  # fmt: skip
        BlockTables([16], 2, [4], "cpu", backend=BadLender())
    writer = FusedStagedWriter("cpu", BadLender())
    t = StagedWriteTensor((2, 3), torch.int32)
    t.stage_write(1, 0, [4, 5, 6])
    with pytest.raises(BackendContractError, match=r"staging_buffers\(cpu, int32\) returned 'pinned memory'"):
        writer.apply([t])  # asked after the apply landed the writes, which stay landed
    assert t.tensor.tolist() == [[0, 0, 0], [4, 5, 6]] and t.num_staged_writes == 0


class Reentrant(Good):
    NAME = "reentrant"
    CALL = "available_backends"

    def not_supported_reasons(self, device, dtypes=()):
        getattr(__import__("multiwrite"), self.CALL)("cpu")
        return []


@pytest.mark.parametrize("call", ["available_backends", "select_backend"])
def test_a_hook_calling_back_into_the_host_is_refused_naming_the_plugin(call):
    pm = get_plugin_manager()

    class Plugin:
        @hookimpl
        def multiwrite_backends(self):
            getattr(__import__("multiwrite"), call)("cpu")
            return [Good()]

    plugin = Plugin()
    pm.register(plugin, name="calling-plugin")
    try:
        (s,) = _named("calling-plugin")
    finally:
        pm.unregister(plugin)
    assert s.reasons == [
        f"multiwrite_backends() raised PluginReentryError: {call}() was called from inside the multiwrite_backends "
        "hook of plugin 'calling-plugin', which the plugin host is running for an earlier call: the host does not "
        "re-enter (it would run the same plugin code again, recursing). Call it from Backend.apply or at import, not "
        "from multiwrite_backends, priority or not_supported_reasons"
    ]
    assert "RecursionError" not in s.traceback
    assert not any("RecursionError" in r for x in available_backends("cpu") for r in x.reasons)


@pytest.mark.parametrize("call", ["available_backends", "select_backend"])
def test_a_backend_calling_back_into_the_host_from_its_checks_is_refused_naming_it(register, call):
    backend = Reentrant()
    backend.CALL = call
    register("reentrant-plugin", backend)
    (s,) = _named("reentrant")
    assert s.reasons == [
        f"not_supported_reasons(cpu) raised PluginReentryError: {call}() was called from inside backend 'reentrant' "
        f"({__name__}.Reentrant) of plugin 'reentrant-plugin', which the plugin host is running for an earlier call: "
        "the host does not re-enter (it would run the same plugin code again, recursing). Call it from Backend.apply "
        "or at import, not from multiwrite_backends, priority or not_supported_reasons"
    ]
    assert select_backend("cpu").NAME == CPU_DEFAULT
