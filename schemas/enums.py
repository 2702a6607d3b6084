"""The enumerations every record shares: operations, data types, roles, phases, and the
kinds, causes and states of verdicts, alerts and dead letters (``LowCardinality(String)``
columns in ClickHouse, strings in JSON)."""

from __future__ import annotations

from enum import StrEnum


class ClockSource(StrEnum):
    """Where a record's timestamps come from."""

    HOST_REALTIME = "host_realtime"
    PTP = "ptp"
    GPU_GLOBALTIMER = "gpu_globaltimer"
    SIMULATED = "simulated"


class CollOp(StrEnum):
    """Collective and point-to-point operation names (NCCL spelling)."""

    ALL_REDUCE = "AllReduce"
    ALL_GATHER = "AllGather"
    REDUCE_SCATTER = "ReduceScatter"
    BROADCAST = "Broadcast"
    REDUCE = "Reduce"
    ALL_TO_ALL = "AllToAll"
    GATHER = "Gather"
    SCATTER = "Scatter"
    SEND = "Send"
    RECV = "Recv"
    BARRIER = "Barrier"

    @property
    def is_p2p(self) -> bool:
        return self in _P2P


_P2P = frozenset((CollOp.SEND, CollOp.RECV))


#: PyTorch's and NCCL's spellings of operations (Kineto, Flight Recorder, torch.distributed),
#: lower case: every name PyTorch's Flight Recorder writes (``profiling_name`` after the
#: backend), the coalesced and out-of-place forms among them; ``split`` (a communicator
#: split) and ``new_window`` synchronise the group like a barrier.
TORCH_OP_NAMES: dict[str, CollOp] = {
    "_all_gather_base": CollOp.ALL_GATHER,
    "all_gather_single": CollOp.ALL_GATHER,
    "all_gather_v": CollOp.ALL_GATHER,
    "allgather_coalesced": CollOp.ALL_GATHER,
    "reduce_scatter_single": CollOp.REDUCE_SCATTER,
    "reduce_scatter_v": CollOp.REDUCE_SCATTER,
    "reduce_scatter_coalesced": CollOp.REDUCE_SCATTER,
    "allreduce_coalesced": CollOp.ALL_REDUCE,
    "all_reduce_coalesced": CollOp.ALL_REDUCE,
    "all_reduce_barrier": CollOp.BARRIER,
    "_broadcast_oop": CollOp.BROADCAST,
    "_reduce_oop": CollOp.REDUCE,
    "all_to_all_v_single": CollOp.ALL_TO_ALL,
    "gather": CollOp.GATHER,
    "scatter": CollOp.SCATTER,
    "split": CollOp.BARRIER,
    "new_window": CollOp.BARRIER,
    "allreduce": CollOp.ALL_REDUCE,
    "all_reduce": CollOp.ALL_REDUCE,
    "allgather": CollOp.ALL_GATHER,
    "all_gather": CollOp.ALL_GATHER,
    "_allgather_base": CollOp.ALL_GATHER,
    "all_gather_into_tensor": CollOp.ALL_GATHER,
    "all_gather_into_tensor_coalesced": CollOp.ALL_GATHER,
    "reduce_scatter": CollOp.REDUCE_SCATTER,
    "_reduce_scatter_base": CollOp.REDUCE_SCATTER,
    "reduce_scatter_tensor": CollOp.REDUCE_SCATTER,
    "reduce_scatter_tensor_coalesced": CollOp.REDUCE_SCATTER,
    "broadcast": CollOp.BROADCAST,
    "reduce": CollOp.REDUCE,
    "all_to_all": CollOp.ALL_TO_ALL,
    "all_to_all_single": CollOp.ALL_TO_ALL,
    "alltoall": CollOp.ALL_TO_ALL,
    "alltoall_base": CollOp.ALL_TO_ALL,
    "barrier": CollOp.BARRIER,
    "send": CollOp.SEND,
    "recv": CollOp.RECV,
}


def torch_op(name: str) -> CollOp | None:
    """The operation a PyTorch/NCCL name stands for (``nccl:all_reduce`` -> AllReduce); a
    Flight Recorder point-to-point name carries its ends after a space (``nccl:send
    0->1``).

    >>> torch_op("nccl:_allgather_base"), torch_op("nccl:send 0->1"), torch_op("gemm")
    (<CollOp.ALL_GATHER: 'AllGather'>, <CollOp.SEND: 'Send'>, None)
    """
    op = name.split(":", 1)[-1].strip().split(" ", 1)[0].lower()
    return TORCH_OP_NAMES.get(op)


class DType(StrEnum):
    """Element types, with their size in bytes in :data:`DTYPE_BYTES`."""

    INT8 = "int8"
    UINT8 = "uint8"
    INT32 = "int32"
    UINT32 = "uint32"
    INT64 = "int64"
    UINT64 = "uint64"
    FLOAT16 = "float16"
    BFLOAT16 = "bfloat16"
    FLOAT32 = "float32"
    FLOAT64 = "float64"
    FP8_E4M3 = "fp8_e4m3"
    FP8_E5M2 = "fp8_e5m2"


DTYPE_BYTES: dict[DType, int] = {
    DType.INT8: 1,
    DType.UINT8: 1,
    DType.INT32: 4,
    DType.UINT32: 4,
    DType.INT64: 8,
    DType.UINT64: 8,
    DType.FLOAT16: 2,
    DType.BFLOAT16: 2,
    DType.FLOAT32: 4,
    DType.FLOAT64: 8,
    DType.FP8_E4M3: 1,
    DType.FP8_E5M2: 1,
}


class CommRole(StrEnum):
    """What a communicator is used for in the parallel layout."""

    TP = "tp"
    PP = "pp"
    DP = "dp"
    CP = "cp"
    EP = "ep"
    WORLD = "world"
    OTHER = "other"


class Schedule(StrEnum):
    """Pipeline schedule of the job."""

    ONE_F_ONE_B = "1f1b"
    INTERLEAVED_1F1B = "interleaved_1f1b"
    GPIPE = "gpipe"
    NONE = "none"


class Direction(StrEnum):
    SEND = "send"
    RECV = "recv"


class KernelKind(StrEnum):
    COMPUTE = "compute"
    NCCL = "nccl"
    MEMCPY = "memcpy"
    MEMSET = "memset"
    OTHER = "other"


class Phase(StrEnum):
    """Where in the training step something happened."""

    FORWARD = "forward"
    BACKWARD = "backward"
    DP_SYNC = "dp_sync"
    OPTIMIZER = "optimizer"
    TRANSFER = "transfer"
    UNKNOWN = "unknown"


class VerdictKind(StrEnum):
    HANG = "hang"
    SLOWDOWN = "slowdown"
    #: one rank slower for a few steps, then back: its culprit, steps and time lost
    TRANSIENT_STRAGGLER = "transient_straggler"
    INTERMITTENT_SLOWDOWN = "intermittent_slowdown"
    LINK_DEGRADATION = "link_degradation"


class Cause(StrEnum):
    COMPUTE = "compute"
    NETWORK_LINK = "network_link"
    NIC = "nic"
    HOST_CPU = "host_cpu"
    UNKNOWN = "unknown"


class VerdictStatus(StrEnum):
    OPEN = "open"
    UPDATE = "update"
    RESOLVED = "resolved"


class AlertLevel(StrEnum):
    """How loudly an incident is announced (webhooks route on it)."""

    INFO = "info"
    WARNING = "warning"
    CRITICAL = "critical"


class DeadLetterReason(StrEnum):
    """Why a record was refused; one counter per reason."""

    MALFORMED = "malformed"
    UNKNOWN_TYPE = "unknown_type"
    UNKNOWN_VERSION = "unknown_version"
    MISSING_FIELD = "missing_field"
    WRONG_TYPE = "wrong_type"
    OUT_OF_RANGE = "out_of_range"
    INCONSISTENT = "inconsistent"
    #: a record type only megatrace's analysis writes (a verdict, a label), sent as input
    NOT_AN_INPUT = "not_an_input"
    #: a rank or communicator outside the job's layout: never evidence
    OUT_OF_LAYOUT = "out_of_layout"
    #: older than the tables' retention: ClickHouse would drop it at insert
    RETENTION = "retention"
    #: a row the store refused even alone
    REFUSED_BY_STORE = "refused_by_store"
    #: a record of a job whose job record never came, beyond what is held waiting for it
    NO_JOB_RECORD = "no_job_record"
