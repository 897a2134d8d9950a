#!/usr/bin/env python3
"""Writes the hand-made seeds of the import fuzz corpus (tests/fuzz_import.rs).

`ok-*.tar` must import, `refuse-*.tar` must be refused (each through every
target: base import, a layer over another, an upload into a directory).
Seeds named `*-found-*` are cases the fuzzing found (written by the fuzz test
into target/fuzz-failures/ and copied here); this script does not make them.
Run from this directory: python3 make_seeds.py
"""
import io
import tarfile

END = b"\0" * 1024


def block(data):
    return data + b"\0" * ((512 - len(data) % 512) % 512)


def hdr(name, type_=tarfile.REGTYPE, size=0, linkname="", fmt=tarfile.USTAR_FORMAT, **kw):
    t = tarfile.TarInfo(name)
    t.type = type_
    t.size = size
    t.linkname = linkname
    t.mode = kw.get("mode", 0o644)
    t.mtime = 1_600_000_000
    for k in ("devmajor", "devminor", "uid"):
        if k in kw:
            setattr(t, k, kw[k])
    return t.tobuf(fmt, "utf-8", "surrogateescape")


def raw_name_hdr(name: bytes, type_=tarfile.REGTYPE, size=0, linkname=b""):
    """A ustar header with a raw byte name (tarfile refuses none, but this
    keeps it byte exact)."""
    h = bytearray(hdr("x", type_, size))
    h[0:100] = name[:100].ljust(100, b"\0")
    h[157:257] = linkname[:100].ljust(100, b"\0")
    h[148:156] = b" " * 8
    h[148:155] = b"%06o\0" % sum(h) + b" "
    return bytes(h[:512])


def pax_rec(k: bytes, v: bytes) -> bytes:
    rest = len(k) + len(v) + 3
    n = rest + 1
    while n != rest + len(str(n)):
        n = rest + len(str(n))
    return b"%d %s=%s\n" % (n, k, v)


def pax(body: bytes, global_=False):
    t = tarfile.XGLTYPE if global_ else tarfile.XHDTYPE
    return hdr("PaxHeader", t, len(body)) + block(body)


def file(name, data=b"x\n", **kw):
    return hdr(name, size=len(data), **kw) + block(data)


def write(name, data):
    with open(name, "wb") as f:
        f.write(data)


def tf(members, fmt):
    b = io.BytesIO()
    with tarfile.open(fileobj=b, mode="w", format=fmt) as t:
        for m, data in members:
            t.addfile(m, io.BytesIO(data) if data is not None else None)
    return b.getvalue()


def ti(name, type_=tarfile.REGTYPE, data=None, linkname="", pax=None, mode=0o644):
    t = tarfile.TarInfo(name)
    t.type = type_
    t.mode = mode
    t.mtime = 1_600_000_000
    t.linkname = linkname
    if data is not None:
        t.size = len(data)
    if pax:
        t.pax_headers = pax
    return (t, data)


# Seeds that import.
write("ok-plain.tar", tf([
    ti("etc", tarfile.DIRTYPE, mode=0o755),
    ti("etc/motd", data=b"hello\n"),
    ti("etc/motd.link", tarfile.LNKTYPE, linkname="etc/motd"),
    ti("bin", tarfile.DIRTYPE, mode=0o755),
    ti("bin/abs", tarfile.SYMTYPE, linkname="/etc/passwd"),
    ti("bin/up", tarfile.SYMTYPE, linkname="../../.."),
    ti("fifo", tarfile.FIFOTYPE),
], tarfile.USTAR_FORMAT))
long = "d/" + "n" * 150 + "/" + "f" * 120
write("ok-pax-long-names.tar", tf([
    ti(long, data=b"long\n", pax={"SCHILY.xattr.user.k": "v"}),
    ti("l", tarfile.SYMTYPE, linkname="t" * 200),
], tarfile.PAX_FORMAT))
write("ok-gnu-long-names.tar", tf([
    ti(long, data=b"long\n"),
    ti("h", tarfile.LNKTYPE, linkname=long),
], tarfile.GNU_FORMAT))
write("ok-whiteouts.tar",
      file("d/.wh..wh..opq", b"") + file("d/keep") + file(".wh.gone", b"") + file("d/.wh.x", b"") + END)
write("ok-pax-size-agrees.tar", pax(pax_rec(b"size", b"5")) + file("f", b"12345") + END)
write("ok-one-end-block.tar", file("f") + b"\0" * 512)
write("ok-global-comment.tar", pax(pax_rec(b"comment", b"git archive"), True) + file("f") + END)
write("ok-root-entry.tar", hdr("./", tarfile.DIRTYPE, mode=0o755) + file("./a") + END)

# Seeds that must be refused.
write("refuse-dotdot.tar", file("../outside/x") + END)
write("refuse-dotdot-inner.tar", file("a/../../outside/x") + END)
write("refuse-absolute.tar", file("/tmp/layerstack-fuzz-absolute") + END)
write("refuse-hardlink-out.tar", hdr("h", tarfile.LNKTYPE, linkname="../outside/sentinel") + END)
write("refuse-hardlink-abs.tar", hdr("h", tarfile.LNKTYPE, linkname="/etc/passwd") + END)
write("refuse-symlink-through.tar",
      hdr("a", tarfile.SYMTYPE, linkname="/", mode=0o777) + file("a/tmp/layerstack-fuzz-through") + END)
write("refuse-symlink-up-through.tar",
      hdr("up", tarfile.SYMTYPE, linkname="..", mode=0o777) + file("up/outside/planted") + END)
write("refuse-char-0-0.tar", hdr("wh", tarfile.CHRTYPE, devmajor=0, devminor=0) + END)
write("refuse-overlay-xattr.tar",
      pax(pax_rec(b"SCHILY.xattr.trusted.overlay.opaque", b"y")) + hdr("d/", tarfile.DIRTYPE, mode=0o755) + END)
write("refuse-user-overlay-xattr.tar",
      pax(pax_rec(b"SCHILY.xattr.user.overlay.redirect", b"/x")) + file("f") + END)
write("refuse-nul-in-long-name.tar",
      hdr("././@LongLink", tarfile.GNUTYPE_LONGNAME, 12) + block(b"a\0../../x\0\0\0") + file("innocent") + END)
write("refuse-unknown-type.tar", hdr("v", b"V") + END)
write("refuse-bad-whiteout.tar", file(".wh..wh.x", b"") + END)
# TARmageddon (CVE-2025-62518): PAX size 1024, header size 0, a hidden
# entry in the content.
hidden = file("smuggled", b"evil")
write("refuse-tarmageddon.tar", pax(pax_rec(b"size", b"%d" % len(hidden))) + hdr("carrier", size=0) + hidden + END)
# The same with a malformed record before the size: the tar crate then
# ignores the size, takes the header's 0, and reads the content as headers;
# on the root's own entry `./` nothing else looked at the records.
write("refuse-pax-malformed-before-size.tar",
      pax(b"5 a=b\n" + pax_rec(b"size", b"%d" % len(hidden))) + hdr("./", tarfile.DIRTYPE, mode=0o755) + hidden + END)
write("refuse-pax-size-twice.tar",
      pax(pax_rec(b"size", b"0") + pax_rec(b"size", b"%d" % len(hidden))) + hdr("carrier", size=0) + hidden + END)
write("refuse-pax-size-not-a-number.tar",
      pax(pax_rec(b"size", b"+1024")) + hdr("carrier", size=0) + hidden + END)
write("refuse-pax-path-twice.tar",
      pax(pax_rec(b"path", b"ok") + pax_rec(b"path", b"../outside/x")) + file("f") + END)
# Data on a directory: tar-rs skips it, Go's archive/tar reads it as headers.
write("refuse-dir-with-data.tar", hdr("d/", tarfile.DIRTYPE, size=len(hidden), mode=0o755) + hidden + END)
write("refuse-global-path.tar", pax(pax_rec(b"path", b"../outside/x"), True) + file("f") + END)
write("refuse-global-size.tar", pax(pax_rec(b"size", b"0"), True) + file("f") + END)
# Cut at an entry boundary: no end-of-archive blocks.
write("refuse-truncated-at-boundary.tar", file("a") + file("b"))
write("refuse-truncated-in-data.tar", (file("a", b"y" * 600) + END)[:700])
write("refuse-truncated-in-header.tar", (file("a") + file("b") + END)[:1300])
write("refuse-empty.tar", b"")
write("refuse-bad-checksum.tar", file("a")[:148] + b"0000000\0" + file("a")[156:] + END)
