"""``python -m services.migration_executor``: run the migration executor service."""

from torchrelay.service import run_service

from .service import ExecutorSettings, setup


def main() -> None:
    """Run the migration executor until SIGTERM."""
    run_service("migration_executor", setup, ExecutorSettings)


if __name__ == "__main__":
    main()
