"""udev rule parsing and matching (pure, no udev): udev's documented semantics.

References: udev(7) "Rules Files", systemd ``src/udev/udev-rules.c`` (``parse_line``,
``udev_rule_parse_value``, ``rule_line_add_token``, ``token_match_string``,
``udev_rule_apply_parent_token_to_event``) and glibc ``fnmatch(3)``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import re
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from discovery_handlers.base import DeviceSpec, InvalidDiscoveryDetailsError
from discovery_handlers.udev.details import parse_details
from discovery_handlers.udev.devices import Found, build_devices, group
from discovery_handlers.udev.glob import fnmatch
from discovery_handlers.udev.handler import UdevHandler
from discovery_handlers.udev.rules import (
    SUPPORTED_KEYS,
    UNSUPPORTED_UDEV_KEYS,
    RuleSyntaxError,
    parse_rule,
)

# -- a fake device tree -----------------------------------------------------------------


@dataclass
class FakeDevice:
    devpath: str
    subsystem: str | None = None
    driver: str | None = None
    properties: dict[str, str] = field(default_factory=dict)
    attributes: dict[str, bytes] = field(default_factory=dict)
    tags: frozenset[str] = frozenset()
    parent: FakeDevice | None = None

    @property
    def kernel(self) -> str:
        return self.devpath.rsplit("/", 1)[-1]

    def property(self, name: str) -> str | None:
        return self.properties.get(name)

    def attribute(self, name: str) -> bytes | None:
        return self.attributes.get(name)


def usb_camera() -> FakeDevice:
    """pci -> usb device 1-1 (idVendor) -> interface 1-1:1.0 (uvcvideo) -> video0."""
    pci = FakeDevice("/devices/pci0000:00/0000:00:14.0", subsystem="pci", driver="xhci_hcd")
    usb = FakeDevice(
        "/devices/pci0000:00/0000:00:14.0/usb1/1-1",
        subsystem="usb",
        driver="usb",
        attributes={"idVendor": b"046d", "idProduct": b"0825", "serial": b"ABC  \t"},
        tags=frozenset({"seat"}),
        parent=pci,
    )
    interface = FakeDevice(
        "/devices/pci0000:00/0000:00:14.0/usb1/1-1/1-1:1.0",
        subsystem="usb",
        driver="uvcvideo",
        attributes={"bInterfaceClass": b"0e"},
        parent=usb,
    )
    return FakeDevice(
        "/devices/pci0000:00/0000:00:14.0/usb1/1-1/1-1:1.0/video4linux/video0",
        subsystem="video4linux",
        properties={"ID_V4L_CAPABILITIES": ":capture:", "DEVNAME": "/dev/video0"},
        attributes={"name": b"Webcam C270", "index": b"0"},
        tags=frozenset({"uaccess", "seat"}),
        parent=interface,
    )


def matches(rule: str, device: FakeDevice) -> bool:
    return parse_rule(rule).matches_device(device)


# -- parsing ----------------------------------------------------------------------------


def test_akri_examples_parse() -> None:
    rule = parse_rule('KERNEL=="video[0-9]*", ENV{ID_V4L_CAPABILITIES}==":capture:"')
    assert [(m.key, m.name, m.negate, m.value) for m in rule.matches] == [
        ("KERNEL", None, False, b"video[0-9]*"),
        ("ENV", "ID_V4L_CAPABILITIES", False, b":capture:"),
    ]
    rule = parse_rule('SUBSYSTEM=="tty", ATTRS{idVendor}=="0403", ATTRS{idProduct}!="6001"')
    assert [(m.key, m.name, m.negate) for m in rule.matches] == [
        ("SUBSYSTEM", None, False),
        ("ATTRS", "idVendor", False),
        ("ATTRS", "idProduct", True),
    ]


@pytest.mark.parametrize(
    "text",
    [
        'KERNEL=="a",SUBSYSTEM=="b"',
        'KERNEL=="a" SUBSYSTEM=="b"',  # udev accepts whitespace alone
        '  KERNEL == "a" ,, SUBSYSTEM=="b",  ',
        '\tKERNEL=="a"\t,\tSUBSYSTEM=="b"',
        'KERNEL=="a"SUBSYSTEM=="b"',  # udev does not require a separator after a value
    ],
)
def test_separators_as_udev(text: str) -> None:
    rule = parse_rule(text)
    assert [(m.key, m.value) for m in rule.matches] == [("KERNEL", b"a"), ("SUBSYSTEM", b"b")]


def test_quoting_as_udev() -> None:
    # plain strings: only \" is unescaped; other backslashes stay (they escape glob chars)
    (m,) = parse_rule(r'ATTR{name}=="say \"hi\" \* \n"').matches
    assert m.value == b'say "hi" \\* \\n'
    # e"..." takes C escapes
    (m,) = parse_rule(r'ENV{X}==e"a\tb\x41\101\u00e9\"\\\s"').matches
    assert m.value == b'a\tbAA\xc3\xa9"\\ '
    # i"..." is case-insensitive, both prefixes may be combined once
    (m,) = parse_rule('KERNEL==ei"VIDEO\\x30"').matches
    assert m.case_insensitive and m.value == b"VIDEO0"
    # spaces are allowed around the operator; an empty value is valid
    (m,) = parse_rule('ENV{X}  !=  ""').matches
    assert m.negate and m.value == b""


def error_of(text: str) -> RuleSyntaxError:
    with pytest.raises(RuleSyntaxError) as info:
        parse_rule(text)
    error = info.value
    assert f"column {error.column}" in str(error)
    assert repr(error.token) in str(error)
    return error


@pytest.mark.parametrize("operator", ["=", "+=", "-=", ":="])
@pytest.mark.parametrize("key", ["KERNEL", "ATTR{idVendor}", "ENV{ID_X}", "TAG", "ATTRS{x}"])
def test_assignment_operators_are_rejected_at_the_operator(key: str, operator: str) -> None:
    text = f'SUBSYSTEM=="usb", {key}{operator}"x"'
    error = error_of(text)
    assert error.column == len('SUBSYSTEM=="usb", ') + len(key) + 1
    assert error.token == operator
    assert "== and !=" in error.reason
    assert text[error.column - 1 :].startswith(operator)


@pytest.mark.parametrize("key", sorted(UNSUPPORTED_UDEV_KEYS))
@pytest.mark.parametrize("operator", ["==", "=", "+="])
def test_unsupported_udev_keys_are_rejected_at_the_key(key: str, operator: str) -> None:
    attr = "{program}" if key in ("IMPORT", "RUN", "SYSCTL", "CONST", "SECLABEL") else ""
    text = f'KERNEL=="video0", {key}{attr}{operator}"value"'
    error = error_of(text)
    assert error.column == len('KERNEL=="video0", ') + 1
    assert error.token == f"{key}{attr}"
    assert "not supported" in error.reason


def test_the_issue_list_of_rejected_keys_is_covered() -> None:
    for key in ("RUN", "NAME", "PROGRAM", "GOTO", "LABEL", "SYMLINK", "MODE", "OWNER"):
        assert key in UNSUPPORTED_UDEV_KEYS
    for key in ("GROUP", "ACTION", "IMPORT", "TEST", "OPTIONS", "RESULT", "SECLABEL"):
        assert key in UNSUPPORTED_UDEV_KEYS
    assert not set(UNSUPPORTED_UDEV_KEYS) & set(SUPPORTED_KEYS)


@pytest.mark.parametrize(
    ("text", "column", "token", "reason"),
    [
        ('KERNEL=="a", FOO=="b"', 14, "FOO", "unknown key"),
        ('kernel=="a"', 1, "kernel", "unknown key"),  # keys are case-sensitive
        ("KERNEL==video0", 9, "video0", "double-quoted"),
        ("KERNEL=='video0'", 9, "'video0'", "double-quoted"),
        ('KERNEL=="video0', 9, '"video0', "unterminated"),
        ('KERNEL=="a", SUBSYSTEM', 14, "SUBSYSTEM", "incomplete"),
        ('KERNEL "a"', 8, '"a"', "expected an operator"),
        ("KERNEL", 1, "KERNEL", "incomplete"),
        ('ATTR{}=="x"', 1, "ATTR{}", "needs a name"),
        ('ENV=="x"', 1, "ENV", "needs a name"),
        ('KERNEL{x}=="y"', 1, "KERNEL{x}", "takes no {name}"),
        ('ATTRS{idVendor=="x"', 6, 'ATTRS{idVendor=="x"', "unterminated '{'"),
        ('ATTR{$kernel}=="x"', 6, "$kernel", "substitutions"),
        ('ATTRS{[usb/1-1]idVendor}=="x"', 7, "[usb/1-1]idVendor", "substitutions"),
        ('=="x"', 1, '=="x"', "missing key"),
        ("", 1, "", "empty rule"),
        (" , ,", 1, " , ,", "empty rule"),
        ('KERNEL==e"\\q"', 11, "\\q", "unknown escape"),
        ('KERNEL==e"\\x0"', 11, "\\x0", "\\x escape"),
        ('KERNEL==e"\\x00"', 11, "\\x00", "\\x escape"),
        ('KERNEL==e"\\000"', 11, "\\000", "octal"),
        ('KERNEL==x"a"', 9, 'x"a"', "double-quoted"),
        ('KERNEL==ee"a"', 9, 'ee"a"', "double-quoted"),
        ('KERNEL=="a"\0', 12, "\\0", "NUL"),
    ],
)
def test_errors_point_at_the_token(text: str, column: int, token: str, reason: str) -> None:
    error = error_of(text)
    assert (error.column, error.token) == (column, token)
    assert reason in error.reason


# -- string matching ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("pattern", "value", "expected"),
    [
        ("video0", "video0", True),
        ("video0", "video01", False),
        ("video*", "video", True),
        ("video*", "video12", True),
        ("video?", "video1", True),
        ("video?", "video12", False),
        ("video[0-9]", "video7", True),
        ("video[0-9]", "videoa", False),
        ("video[0-9]*", "video10", True),
        ("video[!0-9]", "videoa", True),
        ("video[!0-9]", "video1", False),
        ("video[^0-9]", "videoa", True),  # glibc accepts ^ as well
        ("[]a]", "]", True),  # a leading ] is a member
        ("[!]a]", "b", True),
        ("[a-]", "-", True),  # a trailing - is a member
        ("[[:digit:]]x", "7x", True),
        ("[[:upper:]]", "a", False),
        ("[[:bogus:]]", "a", False),  # an unknown class never matches
        ("a\\*b", "a*b", True),  # backslash escapes in globs
        ("a\\*b", "axb", False),
        ("a[b", "a[b", True),  # an unterminated [ is an ordinary character
        ("*", "a/b/.c", True),  # * crosses / and leading dots (no FNM_PATHNAME/PERIOD)
        ("/devices/*/usb1/*", "/devices/pci0000:00/0000:00:14.0/usb1/1-1", True),
        ("abc\\", "abc\\", False),  # glibc: a trailing backslash never matches
    ],
)
def test_glob_cases(pattern: str, value: str, expected: bool) -> None:
    assert fnmatch(pattern.encode(), value.encode()) is expected
    if pattern.endswith("\\"):
        return  # a value cannot end with a backslash: \" is an escaped quote
    device = FakeDevice("/devices/x/" + value if "/" not in value else value)
    key = "DEVPATH" if value.startswith("/") else "ENV{V}"
    device.properties["V"] = value
    escaped = pattern.replace('"', '\\"')
    assert matches(f'{key}=="{escaped}"', device) is expected


@pytest.mark.parametrize(
    ("value", "candidate", "expected"),
    [
        ("ttyUSB0|ttyACM0", "ttyACM0", True),  # | separates alternatives
        ("ttyUSB0|ttyACM0", "ttyUSB0|ttyACM0", False),  # ... always, also literally
        ("ttyUSB*|ttyACM*", "ttyACM3", True),
        ("ttyUSB*|ttyACM*", "ttyS0", False),
        ("|foo", "", True),  # an empty alternative matches the empty string
        ("foo|", "", True),
        ("foo||bar", "", True),
        ("foo|bar", "", False),
        ("", "", True),
        ("", "x", False),
        ("?*", "x", True),  # udev turns =="?*" into !=""
        ("?*", "", False),
        ("[a|b]", "[a", True),  # | splits even inside brackets, as in udev
    ],
)
def test_alternatives_as_udev(value: str, candidate: str, expected: bool) -> None:
    device = FakeDevice("/devices/x", properties={"P": candidate})
    assert matches(f'ENV{{P}}=="{value}"', device) is expected
    assert matches(f'ENV{{P}}!="{value}"', device) is (not expected)


def test_question_star_keeps_the_written_operator() -> None:
    (m,) = parse_rule('ENV{P}=="?*"').matches
    assert not m.negate and m.invert  # udev evaluates it as ENV{P}!=""
    device = FakeDevice("/devices/x", properties={"P": "1"}, attributes={"a": b"  "})
    assert matches('ENV{P}=="?*"', device) and not matches('ENV{P}!="?*"', device)
    assert not matches('ENV{Q}=="?*"', device) and matches('ENV{Q}!="?*"', device)
    assert not matches('ATTR{a}=="?*"', device)  # whitespace-only: stripped to ""
    # udev's TAG=="?*" is TAG!="" which no non-empty tag can fail: always true
    assert matches('TAG=="?*"', FakeDevice("/devices/y"))


def test_plain_values_compare_literally_and_globs_unescape() -> None:
    device = FakeDevice("/devices/x", properties={"P": "a\\b"})
    assert matches('ENV{P}=="a\\b"', device)  # no glob char: strcmp, backslash kept
    assert not matches('ENV{P}=="a\\b*"', device)  # glob: \b is b
    assert matches('ENV{P}=="a\\\\b*"', device)


def test_case_insensitive_values() -> None:
    device = FakeDevice("/devices/x", properties={"P": "Logitech"})
    assert matches('ENV{P}==i"LOGITECH"', device)
    assert matches('ENV{P}==i"log*"', device)
    assert not matches('ENV{P}=="LOGITECH"', device)
    assert not matches('ENV{P}!=i"logitech"', device)


def test_subsystem_words_match_each_other() -> None:
    device = FakeDevice("/devices/x", subsystem="bus")
    assert matches('SUBSYSTEM=="subsystem"', device)
    assert matches('SUBSYSTEM=="class"', device)
    assert not matches('SUBSYSTEMS=="class"', device)  # only SUBSYSTEM has this rule


def test_missing_values() -> None:
    device = FakeDevice("/devices/x")
    # ENV, SUBSYSTEM, DRIVER: absent = empty string
    assert matches('ENV{NOPE}==""', device)
    assert matches('ENV{NOPE}!="x"', device)
    assert matches('DRIVER!="usb"', device)
    assert matches('SUBSYSTEM==""', device)
    # ATTR: an absent attribute never matches, not even with !=
    assert not matches('ATTR{nope}!="x"', device)
    assert not matches('ATTR{nope}==""', device)
    assert not matches('ATTR{nope}=="*"', device)


def test_attribute_trailing_whitespace() -> None:
    device = FakeDevice("/devices/x", attributes={"serial": b"ABC  \t", "empty": b""})
    assert matches('ATTR{serial}=="ABC"', device)  # trailing whitespace ignored ...
    assert not matches('ATTR{serial}=="ABC "', device)  # ... unless the value ends with one
    assert matches('ATTR{serial}=="AB?"', device)
    assert not matches('ATTR{serial}=="ABC *"', device)  # stripped to "ABC" first
    assert matches('ATTR{serial}=="ABC  \t"', device)  # ends with whitespace: compared as is
    assert matches('ATTR{empty}==""', device)
    assert matches('ATTR{serial}=="|ABC"', device)


def test_tag_semantics() -> None:
    device = FakeDevice("/devices/x", tags=frozenset({"uaccess", "seat"}))
    assert matches('TAG=="seat"', device)
    assert matches('TAG=="ua*"', device)
    assert not matches('TAG=="systemd"', device)
    assert matches('TAG!="systemd"', device)  # no tag matches
    assert not matches('TAG!="seat"', device)  # some tag matches
    untagged = FakeDevice("/devices/y")
    assert matches('TAG!="seat"', untagged)
    assert not matches('TAG==""', untagged)  # no tags: nothing to compare


# -- parent walking (udev(7): the S keys search the devpath upwards) ----------------------


def test_device_keys_only_look_at_the_device() -> None:
    video = usb_camera()
    assert matches('SUBSYSTEM=="video4linux", KERNEL=="video0"', video)
    assert not matches('ATTR{idVendor}=="046d"', video)  # idVendor is on a parent
    assert not matches('SUBSYSTEM=="usb"', video)
    assert not matches('DRIVER=="uvcvideo"', video)


def test_parent_keys_include_the_device_itself() -> None:
    video = usb_camera()
    assert matches('KERNELS=="video0"', video)
    assert matches('SUBSYSTEMS=="video4linux"', video)
    assert matches('ATTRS{name}=="Webcam*"', video)
    assert matches('TAGS=="uaccess"', video)


def test_attrs_through_the_parent_chain() -> None:
    video = usb_camera()
    assert matches('SUBSYSTEM=="video4linux", ATTRS{idVendor}=="046d"', video)
    assert matches('ATTRS{idVendor}=="046d", ATTRS{idProduct}=="0825"', video)
    assert not matches('ATTRS{idVendor}=="0403"', video)
    assert matches('DRIVERS=="uvcvideo"', video)
    assert matches('DRIVERS=="xhci_hcd"', video)
    assert matches('KERNELS=="0000:00:14.0"', video)
    assert matches('ATTRS{serial}=="ABC"', video)  # whitespace rule applies to ATTRS too


def test_all_parent_keys_must_match_the_same_ancestor() -> None:
    video = usb_camera()
    # idVendor is on 1-1 (driver usb); uvcvideo is the interface's driver: no single device
    assert not matches('ATTRS{idVendor}=="046d", DRIVERS=="uvcvideo"', video)
    assert matches('ATTRS{idVendor}=="046d", DRIVERS=="usb"', video)
    assert matches('ATTRS{idVendor}=="046d", KERNELS=="1-1"', video)
    assert not matches('ATTRS{idVendor}=="046d", KERNELS=="1-1:1.0"', video)
    assert not matches('ATTRS{idVendor}=="046d", ATTRS{bInterfaceClass}=="0e"', video)
    assert matches('SUBSYSTEMS=="usb", ATTRS{bInterfaceClass}=="0e"', video)
    assert matches('SUBSYSTEMS=="usb", ATTRS{idVendor}=="046d"', video)  # usb twice in the chain
    assert matches('TAGS=="seat", ATTRS{idVendor}=="046d"', video)  # the tag is on 1-1 too
    assert not matches('TAGS=="uaccess", ATTRS{idVendor}=="046d"', video)


def test_negated_parent_keys_are_evaluated_per_ancestor() -> None:
    video = usb_camera()
    # true on the first ancestor where the attribute exists and differs
    assert matches('ATTRS{idVendor}!="0403"', video)
    assert not matches('ATTRS{idVendor}!="046d"', video)  # the only device with it has 046d
    assert matches('KERNELS!="video0"', video)  # a parent's name differs
    assert matches('SUBSYSTEMS=="usb", DRIVERS!="usb"', video)  # the interface (uvcvideo)
    assert matches('SUBSYSTEMS=="usb", DRIVERS!="uvcvideo"', video)  # the usb device
    assert not matches('SUBSYSTEMS=="usb", DRIVERS!="uvcvideo", DRIVERS!="usb"', video)


def test_device_keys_and_parent_keys_combine() -> None:
    video = usb_camera()
    rule = (
        'SUBSYSTEM=="video4linux", ENV{ID_V4L_CAPABILITIES}==":capture:", ATTRS{idVendor}=="046d"'
    )
    assert matches(rule, video)
    video.properties["ID_V4L_CAPABILITIES"] = ":video_output:"
    assert not matches(rule, video)


# -- glibc fnmatch as the oracle ---------------------------------------------------------

_LIBC_NAME = ctypes.util.find_library("c")
_libc = ctypes.CDLL(_LIBC_NAME) if _LIBC_NAME else None
_gnu = _libc is not None and hasattr(_libc, "gnu_get_libc_version")
if _gnu and _libc is not None:
    _libc.fnmatch.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_int]
    _libc.fnmatch.restype = ctypes.c_int
FNM_CASEFOLD = 1 << 4

_PATTERN_ATOMS = st.sampled_from(
    [
        *"ab-]![^\\*?:=.Az09/ ",
        *("[:digit:]", "[:alpha:]", "[:bogus:]", "[=a=]", "[.a.]", "[.ab.]", "[a-z]", "[!b]"),
    ]
)


@pytest.mark.skipif(not _gnu, reason="needs glibc's fnmatch as the reference")
@settings(max_examples=800, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    pattern=st.lists(_PATTERN_ATOMS, max_size=10).map("".join),
    string=st.text(alphabet="ab-]![^\\*?:=.Az09/ ", max_size=8),
    casefold=st.booleans(),
)
def test_glob_is_glibc_fnmatch(pattern: str, string: str, casefold: bool) -> None:
    assert _libc is not None
    expected = _libc.fnmatch(pattern.encode(), string.encode(), FNM_CASEFOLD if casefold else 0)
    assert fnmatch(pattern.encode(), string.encode(), casefold=casefold) is (expected == 0)


@pytest.mark.skipif(not _gnu, reason="needs glibc's fnmatch as the reference")
@settings(max_examples=500, deadline=None)
@given(pattern=st.lists(_PATTERN_ATOMS, max_size=10).map("".join), data=st.data())
def test_glob_is_glibc_fnmatch_on_near_matches(pattern: str, data: st.DataObject) -> None:
    # strings derived from the pattern, so that matches are frequent
    string = "".join(c for c in pattern if c not in "*?\\" or data.draw(st.booleans()))
    string = data.draw(st.sampled_from([string, string[1:], string + "a", "a" + string]))
    assert _libc is not None
    expected = _libc.fnmatch(pattern.encode(), string.encode(), 0) == 0
    assert fnmatch(pattern.encode(), string.encode()) is expected


def test_glob_is_not_exponential() -> None:
    pattern = b"*a*a*a*a*a*a*a*a*a*a*a*a*b"
    assert not fnmatch(pattern, b"a" * 200)
    assert fnmatch(pattern, b"a" * 200 + b"b")


# -- fuzzing: any text parses or raises RuleSyntaxError ------------------------------------

_RULE_ALPHABET = st.sampled_from(
    [*list('KERNELSUBYTMDVPAHIGO{}=!+-:"\\ ,\t*?[]|ei0x'), "==", "!=", "ATTRS{", '"', "\\x"]
)


@settings(max_examples=800, deadline=None)
@given(st.text(max_size=60))
def test_random_text_never_crashes(text: str) -> None:
    try:
        rule = parse_rule(text)
    except RuleSyntaxError as error:
        assert 1 <= error.column <= max(len(text), 1) + 1
        return
    rule.matches_device(usb_camera())


@settings(max_examples=800, deadline=None)
@given(st.lists(_RULE_ALPHABET, max_size=30).map("".join))
def test_rule_like_text_never_crashes(text: str) -> None:
    try:
        rule = parse_rule(text)
    except RuleSyntaxError as error:
        assert 1 <= error.column <= max(len(text), 1) + 1
        assert str(error).startswith(f"column {error.column}: ")
        return
    assert rule.matches
    rule.matches_device(usb_camera())
    rule.matches_device(FakeDevice("/devices/x"))


_VALUE = st.text(
    alphabet=st.characters(blacklist_characters='"\\\0', blacklist_categories=("Cs",)),
    max_size=12,
)


@settings(max_examples=300, deadline=None)
@given(
    pairs=st.lists(
        st.tuples(
            st.sampled_from(
                [
                    *("KERNEL", "SUBSYSTEM", "DRIVER", "DEVPATH", "TAG", "ENV{ID_X}", "ATTR{a/b}"),
                    *("KERNELS", "SUBSYSTEMS", "DRIVERS", "TAGS", "ATTRS{idVendor}"),
                ]
            ),
            st.sampled_from(["==", "!="]),
            _VALUE,
        ),
        min_size=1,
        max_size=5,
    ),
    separator=st.sampled_from([",", ", ", " ", " , "]),
)
def test_generated_rules_round_trip(pairs: list[tuple[str, str, str]], separator: str) -> None:
    text = separator.join(f'{key}{op}"{value}"' for key, op, value in pairs)
    rule = parse_rule(text)
    assert [(m.text, m.negate, m.value) for m in rule.matches] == [
        (f'{key}{op}"{value}"', op == "!=", value.encode()) for key, op, value in pairs
    ]
    for m in rule.matches:
        assert text[m.column - 1 :].startswith(m.text)


# -- discoveryDetails ----------------------------------------------------------------------


def test_details_defaults_and_fields() -> None:
    details = parse_details("udevRules: ['KERNEL==\"video0\"']")
    assert (details.group_recursive, details.permissions) == (False, "rwm")
    assert len(details.rules) == 1
    details = parse_details(
        "udevRules:\n- 'SUBSYSTEM==\"tty\"'\n- 'KERNEL==\"video*\"'\n"
        "groupRecursive: true\npermissions: rw\n"
    )
    assert (len(details.rules), details.group_recursive, details.permissions) == (2, True, "rw")
    assert parse_details("udevRules: []").rules == ()  # Akri accepts an empty list


@pytest.mark.parametrize("permissions", ["r", "w", "m", "rw", "rm", "rwm", "wm"])
def test_permissions_accepted(permissions: str) -> None:
    text = f"udevRules: ['KERNEL==\"a\"']\npermissions: {permissions}"
    assert parse_details(text).permissions == permissions


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("", "udevRules is required"),
        ("groupRecursive: true", "udevRules is required"),
        ("udevRules: 'KERNEL==\"a\"'", "must be a list of strings, got str"),
        ("udevRules: [1]", "udevRules[0] must be a string, got int"),
        ("udevRules: ['KERNEL==\"a\"']\npermissions: mw", "one of r, w, m, rw, rm, rwm, wm"),
        ("udevRules: ['KERNEL==\"a\"']\npermissions: x", "got 'x'"),
        ("udevRules: ['KERNEL==\"a\"']\npermissions: 7", "got 7"),
        ("udevRules: ['KERNEL==\"a\"']\ngroupRecursive: 'yes'", "groupRecursive must be true"),
        ("udevRules: [", "not valid YAML"),
        ("- a", "must be a YAML mapping"),
    ],
)
def test_details_errors(text: str, expected: str) -> None:
    with pytest.raises(InvalidDiscoveryDetailsError) as info:
        parse_details(text)
    assert expected in str(info.value)
    assert str(info.value).startswith("udev: ")


def test_a_misspelt_field_is_a_warning() -> None:
    text = "udevRules: ['KERNEL==\"a\"']\ngroupRecusive: true"
    parse_details(text)  # ignored, like Akri's handler does
    assert "groupRecusive" in UdevHandler().validate(text)[0]


def test_details_error_names_rule_index_column_and_token() -> None:
    text = 'udevRules:\n- \'KERNEL=="video0"\'\n- \'SUBSYSTEM=="tty", RUN+="/bin/sh"\'\n'
    with pytest.raises(InvalidDiscoveryDetailsError) as info:
        UdevHandler().validate(text)
    message = str(info.value)
    assert message.startswith("udev: discoveryDetails.udevRules[1] ")
    assert "column 19" in message and "'RUN'" in message and "not supported" in message
    text = "udevRules: ['KERNEL=\"video0\"']"
    with pytest.raises(InvalidDiscoveryDetailsError, match=re.escape("udevRules[0]")) as info:
        UdevHandler().validate(text)
    assert "column 7" in str(info.value) and "'='" in str(info.value)


# -- device building -----------------------------------------------------------------------


def test_devices_without_grouping() -> None:
    found = [
        Found("/devices/a/video4linux/video0", "/dev/video0"),
        Found("/devices/virtual/net/lo", None),
    ]
    devices = build_devices(found, group_recursive=False, permissions="rw")
    assert [d.id for d in devices] == ["/devices/a/video4linux/video0", "/devices/virtual/net/lo"]
    assert dict(devices[0].properties) == {
        "UDEV_DEVPATH": "/devices/a/video4linux/video0",
        "UDEV_DEVNODE": "/dev/video0",
    }
    assert devices[0].device_specs == (DeviceSpec("/dev/video0", "/dev/video0", "rw"),)
    assert dict(devices[1].properties) == {"UDEV_DEVPATH": "/devices/virtual/net/lo"}
    assert devices[1].device_specs == () and devices[1].mounts == ()


def test_devices_grouped_recursively() -> None:
    found = [
        Found("/devices/usb1/1-1/1-1:1.0/video4linux/video1", "/dev/video1"),
        Found("/devices/usb1/1-1", "/dev/bus/usb/001/002"),
        Found("/devices/usb1/1-1/1-1:1.0/video4linux/video0", "/dev/video0"),
        Found("/devices/usb1/1-10", None),  # a sibling whose name extends 1-1
        Found("/devices/usb1/1-10/1-10:1.0", None),
        Found("/devices/usb2/2-1/2-1:1.0", "/dev/hidraw0"),
    ]
    assert list(group(found)) == [
        "/devices/usb1/1-1",
        "/devices/usb1/1-10",
        "/devices/usb2/2-1/2-1:1.0",
    ]
    devices = build_devices(found, group_recursive=True, permissions="rwm")
    assert [d.id for d in devices] == [
        "/devices/usb1/1-1",
        "/devices/usb1/1-10",
        "/devices/usb2/2-1/2-1:1.0",
    ]
    first = devices[0]
    assert dict(first.properties) == {
        "UDEV_DEVPATH": "/devices/usb1/1-1",
        "UDEV_DEVNODE_0": "/dev/bus/usb/001/002",
        "UDEV_DEVNODE_1": "/dev/video0",
        "UDEV_DEVNODE_2": "/dev/video1",
    }
    assert [s.host_path for s in first.device_specs] == [
        "/dev/bus/usb/001/002",
        "/dev/video0",
        "/dev/video1",
    ]
    assert dict(devices[1].properties) == {"UDEV_DEVPATH": "/devices/usb1/1-10"}
    assert dict(devices[2].properties) == {
        "UDEV_DEVPATH": "/devices/usb2/2-1/2-1:1.0",
        "UDEV_DEVNODE_0": "/dev/hidraw0",
    }


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.lists(st.sampled_from(["a", "b", "a-b", "c"]), min_size=1, max_size=4).map(
            lambda parts: "/devices/" + "/".join(parts)
        ),
        max_size=12,
    )
)
def test_grouping_partitions_by_topmost_match(paths: list[str]) -> None:
    found = [Found(path) for path in paths]
    groups = group(found)
    assume(paths)
    members = [m.devpath for ms in groups.values() for m in ms]
    assert sorted(members) == sorted(set(paths))
    for top, items in groups.items():
        assert not any(top.startswith(other + "/") for other in set(paths))
        for item in items:
            assert item.devpath == top or item.devpath.startswith(top + "/")
