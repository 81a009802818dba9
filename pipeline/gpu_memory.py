"""The job's device memory at two marks, and its peaks: stats.json's `gpu_memory`
(`pipeline.report.GpuMemory`). Off CUDA every mark does nothing and the report is None."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pipeline.report import GpuMemory

GIB = 2**30


def gib(nbytes: int) -> float:
    return round(nbytes / GIB, 3)


@dataclass
class MemoryMarks:
    """Made when the job sets up its device: on CUDA the cached blocks nobody uses are returned and
    the peak statistics reset there, so the reserved figures and the peaks are this job's, not those
    of what ran before in the process. `model` then marks the weights, `denoise` the moment before
    the first batch; `report` adds the peaks."""

    device: torch.device | None  # None off CUDA
    model_bytes: int | None = None
    build_peaks: tuple[int, int] = (0, 0)  # (allocated, reserved) peaks up to the model mark
    denoise_allocated: int | None = None
    denoise_reserved: int | None = None
    text_encoders_resident: bool | None = None

    @classmethod
    def start(cls, device: torch.device) -> "MemoryMarks":
        if device.type != "cuda":
            return cls(None)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        return cls(device)

    def model(self) -> None:
        """The model is built and its kernels applied: allocated bytes are its weights."""
        if self.device is not None:
            self.model_bytes = torch.cuda.memory_allocated(self.device)
            self.build_peaks = (torch.cuda.max_memory_allocated(self.device), torch.cuda.max_memory_reserved(self.device))

    def denoise(self, text_encoders_resident: bool) -> None:
        """The first batch is next: the prompts are encoded (with model.offload_text_encoder the text
        encoders released) and the graphs captured."""
        if self.device is not None:
            self.denoise_allocated = torch.cuda.memory_allocated(self.device)
            self.denoise_reserved = torch.cuda.memory_reserved(self.device)
            self.text_encoders_resident = text_encoders_resident

    def report(self, peaks: tuple[int, int]) -> GpuMemory | None:
        """`peaks`: the device's (allocated, reserved) peaks, `BCGEngine.peak_memory` (its capture
        resets CUDA's peak statistics and keeps what they held); those of the build count too (a
        calibration engine of bcg.ladder=auto resets them as well)."""
        if self.device is None:
            return None
        assert self.model_bytes is not None and self.denoise_allocated is not None, "report before both marks"
        return GpuMemory(
            model_gib=gib(self.model_bytes),
            denoise_allocated_gib=gib(self.denoise_allocated),
            denoise_reserved_gib=gib(self.denoise_reserved),
            peak_allocated_gib=gib(max(peaks[0], self.build_peaks[0])),
            peak_reserved_gib=gib(max(peaks[1], self.build_peaks[1])),
            text_encoders_resident=self.text_encoders_resident,
        )
