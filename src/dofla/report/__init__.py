from dofla.report.tables import find_runs, print_run_summary, write_report

__all__ = ["find_runs", "print_run_summary", "write_report"]
