"""NCCL's profiler structures as ctypes declares them, our own declarations of NCCL's
headers (``ext-profiler/profiler_v4.h`` .. ``profiler_v7.h``): the event descriptors per
API version, the state arguments, and the table of entry points the plugin exports
(:func:`_table`). :class:`~producers.nccl_plugin.Plugin` fills them as NCCL would."""

from __future__ import annotations

import ctypes as C


class _Coll(C.Structure):
    _fields_ = (
        ("seqNumber", C.c_uint64),
        ("func", C.c_char_p),
        ("sendBuff", C.c_void_p),
        ("recvBuff", C.c_void_p),
        ("count", C.c_size_t),
        ("root", C.c_int),
        ("datatype", C.c_char_p),
        ("nChannels", C.c_uint8),
        ("nWarps", C.c_uint8),
        ("algo", C.c_char_p),
        ("proto", C.c_char_p),
        ("parentGroup", C.c_void_p),
    )


class _P2p(C.Structure):
    _fields_ = (
        ("func", C.c_char_p),
        ("buff", C.c_void_p),
        ("datatype", C.c_char_p),
        ("count", C.c_size_t),
        ("peer", C.c_int),
        ("nChannels", C.c_uint8),
        ("parentGroup", C.c_void_p),
    )


class _ProxyOp(C.Structure):
    _fields_ = (
        ("pid", C.c_int),
        ("channelId", C.c_uint8),
        ("peer", C.c_int),
        ("nSteps", C.c_int),
        ("chunkSize", C.c_int),
        ("isSend", C.c_int),
    )


class _Union(C.Union):
    _fields_ = (("coll", _Coll), ("p2p", _P2p), ("proxyOp", _ProxyOp), ("step", C.c_int))


class _CeColl(C.Structure):
    _fields_ = (
        ("seqNumber", C.c_uint64),
        ("func", C.c_char_p),
        ("sendBuff", C.c_void_p),
        ("recvBuff", C.c_void_p),
        ("count", C.c_size_t),
        ("root", C.c_int),
        ("datatype", C.c_char_p),
        ("syncStrategy", C.c_char_p),
        ("intraBatchSync", C.c_bool),
        ("batchSize", C.c_uint32),
        ("numBatches", C.c_uint32),
        ("ceSeqNum", C.c_uint32),
        ("stream", C.c_void_p),
        ("userTag", C.c_uint64),  # v7 (v6's descriptor ends before it)
    )


class _CollV7(C.Structure):
    _fields_ = (*_Coll._fields_, ("kernelVariant", C.c_char_p), ("isSymColl", C.c_bool),
                ("userTag", C.c_uint64))  # fmt: skip


class _P2pV7(C.Structure):
    _fields_ = (*_P2p._fields_, ("userTag", C.c_uint64))


class _KernelPhase(C.Structure):
    _fields_ = (
        ("channelId", C.c_uint8),
        ("phaseId", C.c_uint8),
        ("phaseName", C.c_char_p),
        ("pTimer", C.c_uint64),
    )


class _UnionV7(C.Union):
    _fields_ = (
        ("coll", _CollV7),
        ("p2p", _P2pV7),
        ("proxyOp", _ProxyOp),
        ("step", C.c_int),
        ("ceColl", _CeColl),
        ("kernelPhase", _KernelPhase),
        ("pad", C.c_uint8 * 128),
    )


class _DescrV7(C.Structure):  # v6's too: the same header, and its members a prefix of v7's
    _fields_ = (("type", C.c_uint64), ("parentObj", C.c_void_p), ("rank", C.c_int),
                ("u", _UnionV7))  # fmt: skip


class _DescrV5(C.Structure):
    _fields_ = (("type", C.c_uint64), ("parentObj", C.c_void_p), ("rank", C.c_int), ("u", _Union))


class _DescrV4(C.Structure):
    _fields_ = (("type", C.c_uint8), ("parentObj", C.c_void_p), ("rank", C.c_int), ("u", _Union))


class _StateArgs(C.Union):
    _fields_ = (("transSize", C.c_size_t), ("pTimer", C.c_uint64))


_init_v5 = C.CFUNCTYPE(
    C.c_int, C.POINTER(C.c_void_p), C.c_uint64, C.POINTER(C.c_int), C.c_char_p,
    C.c_int, C.c_int, C.c_int, C.c_void_p,
)  # fmt: skip
_init_v4 = C.CFUNCTYPE(
    C.c_int, C.POINTER(C.c_void_p), C.POINTER(C.c_int), C.c_char_p, C.c_uint64,
    C.c_int, C.c_int, C.c_int, C.c_void_p,
)  # fmt: skip
_stop = C.CFUNCTYPE(C.c_int, C.c_void_p)
_record = C.CFUNCTYPE(C.c_int, C.c_void_p, C.c_int, C.POINTER(_StateArgs))
_finalize = C.CFUNCTYPE(C.c_int, C.c_void_p)


def _descr(version: int) -> type[C.Structure]:
    return {4: _DescrV4, 5: _DescrV5}.get(version, _DescrV7)


def _table(version: int) -> type[C.Structure]:
    descr = _descr(version)
    start = C.CFUNCTYPE(C.c_int, C.c_void_p, C.POINTER(C.c_void_p), C.POINTER(descr))

    class Table(C.Structure):
        _fields_ = (
            ("name", C.c_char_p),
            ("init", _init_v4 if version == 4 else _init_v5),
            ("startEvent", start),
            ("stopEvent", _stop),
            ("recordEventState", _record),
            ("finalize", _finalize),
        )

    return Table
