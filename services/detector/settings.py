"""The detector service's settings (environment ``TORCHRELAY_DETECTOR_*``)."""

from __future__ import annotations

from pydantic import Field

from services.detector.rules import DetectorConfig
from torchrelay.settings import ServiceSettings


class DetectorSettings(ServiceSettings):
    """Settings of the detector service (environment ``TORCHRELAY_DETECTOR_*``)."""

    # Backstop only: a SIGKILL is seen at once through the launcher's exit report and the
    # peers' failed collectives; silence catches hangs and lost nodes. 2 s gave false
    # positives on a loaded 2-core machine while ranks formed their groups.
    detector_heartbeat_timeout_s: float = Field(default=5.0, gt=0)
    # A host launcher beats every 0.5 s; this long silent, its host is lost (or cut off)
    # and every rank on it with it. Shorter than the members' timeout, above a loaded
    # machine's scheduling hiccups.
    detector_launcher_timeout_s: float = Field(default=2.0, gt=0)
    detector_episode_quiet_s: float = Field(default=60.0, gt=0)
    detector_hang_floor_s: float = Field(default=10.0, gt=0)
    detector_hang_factor: float = Field(default=10.0, gt=0)
    detector_straggler_ratio: float = Field(default=1.3, gt=1)
    detector_straggler_sustain_s: float = Field(default=5.0, ge=0)
    detector_breaker_max_share: float = Field(default=0.25, gt=0, le=1)
    detector_breaker_min_nodes: int = Field(default=1, ge=0)
    detector_lemon_threshold: float = Field(default=3.0, gt=0)
    detector_sweep_interval_s: float = Field(default=0.25, gt=0)
    detector_inventory_interval_s: float = Field(default=5.0, gt=0)
    detector_replica_id: str | None = Field(default=None, pattern=r"^[A-Za-z0-9_\-]+$")

    def rules(self) -> DetectorConfig:
        """The rules' thresholds from these settings."""
        return DetectorConfig(
            heartbeat_timeout_s=self.detector_heartbeat_timeout_s,
            launcher_timeout_s=self.detector_launcher_timeout_s,
            episode_quiet_s=self.detector_episode_quiet_s,
            hang_floor_s=self.detector_hang_floor_s,
            hang_factor=self.detector_hang_factor,
            straggler_ratio=self.detector_straggler_ratio,
            straggler_sustain_s=self.detector_straggler_sustain_s,
            breaker_max_share=self.detector_breaker_max_share,
            breaker_min_nodes=self.detector_breaker_min_nodes,
            lemon_threshold=self.detector_lemon_threshold,
        )


__all__ = ["DetectorSettings"]
