from dofla.report.frontier import frontier_plot, frontier_points, frontier_table
from dofla.report.intervals import Interval, crossed_interval, paired_interval
from dofla.report.records import RunRecord, collect_allocation_record, collect_record, load_record, load_records, read_runs
from dofla.report.shares import PairedShareInterval, ShareInterval, paired_share_interval, share_interval
from dofla.report.seeds import paired_vs_fix, seed_groups
from dofla.report.stats import mean_ci, t_quantile, welch_ci
from dofla.report.tables import find_runs, load_run, print_run_summary, run_config, write_report

__all__ = ["find_runs", "load_run", "run_config", "print_run_summary", "write_report", "seed_groups", "paired_vs_fix", "mean_ci", "t_quantile", "welch_ci",
           "Interval", "crossed_interval", "paired_interval", "RunRecord", "collect_allocation_record", "collect_record", "load_record", "load_records", "read_runs",
           "frontier_points", "frontier_table", "frontier_plot",
           "ShareInterval", "PairedShareInterval", "share_interval", "paired_share_interval"]
