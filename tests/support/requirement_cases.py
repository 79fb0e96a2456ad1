"""One table of nodes and job requirements, held against both the Python matcher and SQL."""

from __future__ import annotations

from typing import Any

from app.domain.requirements import Mismatch, NodeProfile, Requirements

NODES = [
    NodeProfile(node_id="a-eu-gpu", tier="A", region="eu", trust_zone="z1",
                hardware={"gpu": True, "memory_gb": 64, "cpu_count": 16},
                capabilities=["embeddings", "gpu", "inference"]),
    NodeProfile(node_id="a-eu-cpu", tier="A", region="eu", trust_zone="z2",
                hardware={"gpu": False, "memory_gb": 16, "cpu_count": 8},
                capabilities=["embeddings"]),
    NodeProfile(node_id="b-us", tier="B", region="us", trust_zone="z1",
                hardware={"gpu": False, "memory_gb": 8, "cpu_count": 4}, capabilities=[]),
    NodeProfile(node_id="c-none", tier="C", region=None, trust_zone=None,
                hardware={}, capabilities=["scraping"]),
]  # fmt: skip


def req(**fields: Any) -> Requirements:
    return Requirements.model_validate(fields)


# (requirements, {node_id: expected mismatches}); nodes not listed match (no mismatches)
CASES: list[tuple[str, Requirements, dict[str, list[Mismatch]]]] = [
    ("no requirements: every node", req(), {}),
    ("tier A", req(tier=["A"]),
     {"b-us": [Mismatch.TIER], "c-none": [Mismatch.TIER]}),
    ("tier A or B", req(tier=["A", "B"]), {"c-none": [Mismatch.TIER]}),
    ("region eu", req(region="eu"),
     {"b-us": [Mismatch.REGION], "c-none": [Mismatch.REGION]}),
    ("trust zone z1", req(trust_zone="z1"),
     {"a-eu-cpu": [Mismatch.TRUST_ZONE], "c-none": [Mismatch.TRUST_ZONE]}),
    ("gpu", req(hardware={"gpu": True}),
     {"a-eu-cpu": [Mismatch.GPU], "b-us": [Mismatch.GPU], "c-none": [Mismatch.GPU]}),
    ("gpu false is no requirement", req(hardware={"gpu": False}), {}),
    ("16 GB", req(hardware={"min_memory_gb": 16}),
     {"b-us": [Mismatch.MEMORY], "c-none": [Mismatch.MEMORY]}),
    ("8 cpus", req(hardware={"min_cpu_count": 8}),
     {"b-us": [Mismatch.CPU], "c-none": [Mismatch.CPU]}),
    ("embeddings", req(capabilities=["embeddings"]),
     {"b-us": [Mismatch.CAPABILITIES], "c-none": [Mismatch.CAPABILITIES]}),
    ("embeddings and inference", req(capabilities=["embeddings", "inference"]),
     {"a-eu-cpu": [Mismatch.CAPABILITIES], "b-us": [Mismatch.CAPABILITIES],
      "c-none": [Mismatch.CAPABILITIES]}),
    # names with every character a name may have (ASCII letters, digits, -_.:), at their
    # longest; compared exactly, case included
    ("names of every allowed character",
     req(region="eu-West_1.a:" + "r" * 52, trust_zone="Z" * 64, capabilities=["embeddings:v2"]),
     {node: [Mismatch.REGION, Mismatch.TRUST_ZONE, Mismatch.CAPABILITIES]
      for node in ("a-eu-gpu", "a-eu-cpu", "b-us", "c-none")}),
    ("names are compared with their case", req(region="EU", trust_zone="Z1"),
     {node: [Mismatch.REGION, Mismatch.TRUST_ZONE]
      for node in ("a-eu-gpu", "a-eu-cpu", "b-us", "c-none")}),
    ("everything", req(tier=["A"], region="eu", trust_zone="z1", capabilities=["embeddings"],
                       hardware={"gpu": True, "min_memory_gb": 32}),
     {"a-eu-cpu": [Mismatch.TRUST_ZONE, Mismatch.GPU, Mismatch.MEMORY],
      "b-us": [Mismatch.TIER, Mismatch.REGION, Mismatch.GPU, Mismatch.MEMORY,
               Mismatch.CAPABILITIES],
      "c-none": [Mismatch.TIER, Mismatch.REGION, Mismatch.TRUST_ZONE, Mismatch.GPU,
                 Mismatch.MEMORY, Mismatch.CAPABILITIES]}),
]  # fmt: skip


def expected_mismatches(node_id: str, expected: dict[str, list[Mismatch]]) -> list[Mismatch]:
    return expected.get(node_id, [])
