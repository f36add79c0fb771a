"""Verbs constants with the names and values of libibverbs (`enum ibv_*`), independent of pyverbs."""
from __future__ import annotations

import enum


class Access(enum.IntFlag):
    """`ibv_access_flags` for memory registration."""

    LOCAL_WRITE = 1
    REMOTE_WRITE = 2
    REMOTE_READ = 4
    REMOTE_ATOMIC = 8

    @classmethod
    def all_rdma(cls) -> "Access":
        return cls.LOCAL_WRITE | cls.REMOTE_WRITE | cls.REMOTE_READ


class WCStatus(enum.IntEnum):
    """`ibv_wc_status`: the status of a work completion."""

    SUCCESS = 0
    LOC_LEN_ERR = 1
    LOC_QP_OP_ERR = 2
    LOC_EEC_OP_ERR = 3
    LOC_PROT_ERR = 4
    WR_FLUSH_ERR = 5
    MW_BIND_ERR = 6
    BAD_RESP_ERR = 7
    LOC_ACCESS_ERR = 8
    REM_INV_REQ_ERR = 9
    REM_ACCESS_ERR = 10
    REM_OP_ERR = 11
    RETRY_EXC_ERR = 12
    RNR_RETRY_EXC_ERR = 13
    LOC_RDD_VIOL_ERR = 14
    REM_INV_RD_REQ_ERR = 15
    REM_ABORT_ERR = 16
    INV_EECN_ERR = 17
    INV_EEC_STATE_ERR = 18
    FATAL_ERR = 19
    RESP_TIMEOUT_ERR = 20
    GENERAL_ERR = 21

    @classmethod
    def _missing_(cls, value: object) -> "WCStatus":
        return cls.GENERAL_ERR  # a status newer than this table is still an error


class WCOpcode(enum.IntEnum):
    """`ibv_wc_opcode`. libibverbs defines it only for successful completions: an error completion
    may carry any value (`UNKNOWN` here when it is none of these)."""

    UNKNOWN = -1
    SEND = 0
    RDMA_WRITE = 1
    RDMA_READ = 2
    COMP_SWAP = 3
    FETCH_ADD = 4
    BIND_MW = 5
    LOCAL_INV = 6
    TSO = 7
    RECV = 128
    RECV_RDMA_WITH_IMM = 129

    @classmethod
    def _missing_(cls, value: object) -> "WCOpcode":
        return cls.UNKNOWN


class QPState(enum.IntEnum):
    """`ibv_qp_state`."""

    RESET = 0
    INIT = 1
    RTR = 2
    RTS = 3
    SQD = 4
    SQE = 5
    ERR = 6


#: `ibv_mtu` enum value -> bytes
MTU_BYTES = {1: 256, 2: 512, 3: 1024, 4: 2048, 5: 4096}
