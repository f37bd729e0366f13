"""A ``Panel`` as Grafana's own typed builders make it (``grafana-foundation-sdk``, generated from
Grafana's schemas): one builder per kind (time series, stat, table, heatmap, state timeline) and
Prometheus's query builder, their model encoded as Grafana's JSON.

What the SDK cannot express: a stat's ``wideLayout`` and ``showPercentChange`` (left out: Grafana's
defaults, true and false, are ours), and a table's field settings (``custom``: cells coloured by the
thresholds), which no builder sets: added to the built JSON (an override by regexp would do it in
Grafana, but Grafana's own JSON Schema refuses its string matcher).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from grafana_foundation_sdk.builders import common as common_builders
from grafana_foundation_sdk.builders import dashboard as dashboard_builders
from grafana_foundation_sdk.builders import heatmap, prometheus, stat, statetimeline, table, timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common
from grafana_foundation_sdk.models import dashboard as models
from grafana_foundation_sdk.models import heatmap as heatmap_models
from grafana_foundation_sdk.models import prometheus as prometheus_models

if TYPE_CHECKING:
    from dashboard_parts.panels import Panel, Query

DATASOURCE = models.DataSourceRef(type_val="prometheus", uid="${datasource}")
# A table's field settings: each cell's text in its threshold's colour.
TABLE_CUSTOM = {"align": "auto", "cellOptions": {"type": "color-text"}, "inspect": False}
THRESHOLDS_OFF = common.GraphTresholdsStyleMode.OFF  # (the SDK's spelling)
HIDE_NOTHING = common_builders.HideSeriesConfig().tooltip(False).legend(False).viz(False)


def as_json(model: Any) -> Any:
    """A built model as the JSON Grafana reads."""
    return json.loads(json.dumps(model, cls=JSONEncoder))


def panel_json(panel: Panel, panel_id: int, x: int, y: int) -> dict[str, Any]:
    builder = _KINDS[panel.kind](panel)
    builder.id(panel_id).title(panel.title).description(panel.description).datasource(DATASOURCE)
    builder.grid_pos(models.GridPos(h=panel.height, w=panel.width, x=x, y=y)).unit(panel.unit)
    stat_like = panel.kind in ("stat", "table")
    color = models.FieldColorModeId.THRESHOLDS if stat_like else models.FieldColorModeId.PALETTE_CLASSIC
    builder.color_scheme(dashboard_builders.FieldColor().mode(panel.color_mode or color))
    steps = [models.Threshold(value=value, color=color) for value, color in panel.thresholds]
    builder.thresholds(dashboard_builders.ThresholdsConfig().mode(models.ThresholdsMode.ABSOLUTE).steps(steps))
    builder.mappings([_mapping(mapping) for mapping in panel.mappings])
    for key in ("decimals", "min", "max"):
        if (value := getattr(panel, key)) is not None:
            getattr(builder, key)(value)
    if panel.links:
        builder.data_links([_link(link) for link in panel.links])
    if panel.no_value is not None:
        builder.no_value(panel.no_value)
    for index, query in enumerate(panel.queries):
        builder.with_target(_target(query, chr(ord("A") + index)))
    for transformation in panel.transformations:
        builder.with_transformation(models.DataTransformerConfig.from_json(transformation))
    built = as_json(builder.build())
    if panel.kind == "table":
        built["fieldConfig"]["defaults"]["custom"] = TABLE_CUSTOM
    return built  # type: ignore[no-any-return]


def _target(query: Query, ref_id: str) -> prometheus.Dataquery:
    target = prometheus.Dataquery().ref_id(ref_id).expr(query.expr).datasource(DATASOURCE)
    target.legend_format(query.legend or "__auto").editor_mode(prometheus_models.QueryEditorMode.CODE)
    target.instant() if query.instant else target.range()
    return target.format(prometheus_models.PromQueryFormat(query.fmt))


def _mapping(mapping: dict[str, Any]) -> models.ValueMapping:
    kinds: dict[str, Any] = {"value": models.ValueMap, "range": models.RangeMap, "special": models.SpecialValueMap}
    return kinds[mapping["type"]].from_json(mapping)  # type: ignore[no-any-return]


def _link(link: dict[str, Any]) -> dashboard_builders.DashboardLink:
    return (
        dashboard_builders.DashboardLink(link["title"])
        .type(models.DashboardLinkType(link["type"]))
        .url(link["url"])
        .icon(link["icon"])
        .tooltip(link["tooltip"])
        .tags(link["tags"])
        .as_dropdown(link["asDropdown"])
        .target_blank(link["targetBlank"])
        .include_vars(link["includeVars"])
        .keep_time(link["keepTime"])
    )


def _timeseries(panel: Panel) -> timeseries.Panel:
    legend_table = panel.legend_table
    legend = (
        common_builders.VizLegendOptions()
        .show_legend(True)
        .display_mode(common.LegendDisplayMode.TABLE if legend_table else common.LegendDisplayMode.LIST)
        .placement(common.LegendPlacement.RIGHT if legend_table else common.LegendPlacement.BOTTOM)
        .calcs(["mean", "max", "lastNotNull"] if legend_table else [])
    )
    stacking = common.StackingMode.NORMAL if panel.stack else common.StackingMode.NONE
    return (
        timeseries.Panel()
        .draw_style(common.GraphDrawStyle.LINE)
        .line_interpolation(common.LineInterpolation.LINEAR)
        .line_width(1)
        .fill_opacity(25 if panel.stack else 8)
        .gradient_mode(common.GraphGradientMode.NONE)
        .show_points(common.VisibilityMode.NEVER)
        .point_size(4)
        .span_nulls(False)
        .insert_nulls(False)
        .stacking(common_builders.StackingConfig().mode(stacking).group("A"))
        .axis_placement(common.AxisPlacement.AUTO)
        .axis_label("")
        .axis_color_mode(common.AxisColorMode.TEXT)
        .axis_centered_zero(False)
        .bar_alignment(common.BarAlignment.CENTER)
        .scale_distribution(common_builders.ScaleDistributionConfig().type(common.ScaleDistribution.LINEAR))
        .hide_from(HIDE_NOTHING)
        .thresholds_style(common_builders.GraphThresholdsStyleConfig().mode(THRESHOLDS_OFF))
        .legend(legend)
        .tooltip(
            common_builders.VizTooltipOptions().mode(common.TooltipDisplayMode.MULTI).sort(common.SortOrder.DESCENDING)
        )
    )


def _stat(panel: Panel) -> stat.Panel:
    return (
        stat.Panel()
        .reduce_options(common_builders.ReduceDataOptions().calcs(["lastNotNull"]).fields("").values(False))
        .orientation(common.VizOrientation.AUTO)
        .text_mode(common.BigValueTextMode.AUTO)
        .color_mode(common.BigValueColorMode.VALUE)
        .graph_mode(common.BigValueGraphMode.AREA)
        .justify_mode(common.BigValueJustifyMode.AUTO)
    )


def _table(panel: Panel) -> table.Panel:
    builder = (
        table.Panel()
        .show_header(True)
        .cell_height(common.TableCellHeight.SM)
        .footer(common_builders.TableFooterOptions().show(False).reducer(["sum"]).fields(""))
    )
    if panel.sort_by:
        builder.sort_by([common_builders.TableSortByFieldState().display_name(panel.sort_by).desc(panel.sort_desc)])
    return builder


def _heatmap(panel: Panel) -> heatmap.Panel:
    # Not calculated: every series (one per node and GPU) is one row of the heatmap.
    color = (
        heatmap.HeatmapColorOptions()
        .mode(heatmap_models.HeatmapColorMode.SCHEME)
        .scheme("RdYlGn")
        .fill("dark-orange")
        .scale(heatmap_models.HeatmapColorScale.LINEAR)
        .exponent(0.5)
        .steps(64)
        .reverse(False)
        .min(0)
        .max(1)
    )
    return (
        heatmap.Panel()
        .calculate(False)
        .cell_gap(1)
        .cell_values(heatmap.CellValues().unit(panel.unit))
        .color(color)
        .exemplars_color("rgba(255,0,255,0.7)")
        .filter_values(heatmap.FilterValueRange().le(1e-9))
        .show_legend()
        .rows_frame(heatmap.RowsHeatmapOptions().layout(common.HeatmapCellLayout.AUTO))
        .show_value(common.VisibilityMode.NEVER)
        .show_tooltip()
        .hide_y_histogram()
        .y_axis(heatmap.YAxisConfig().axis_placement(common.AxisPlacement.LEFT).reverse(True))
        .hide_from(HIDE_NOTHING)
        .scale_distribution(common_builders.ScaleDistributionConfig().type(common.ScaleDistribution.LINEAR))
    )


def _state_timeline(panel: Panel) -> statetimeline.Panel:
    # One band per series, coloured (and named) by the value mappings: a state over time.
    legend = (
        common_builders.VizLegendOptions()
        .show_legend(False)
        .display_mode(common.LegendDisplayMode.LIST)
        .placement(common.LegendPlacement.BOTTOM)
        .calcs([])
    )
    return (
        statetimeline.Panel()
        .line_width(0)
        .fill_opacity(70)
        .hide_from(HIDE_NOTHING)
        .show_value(common.VisibilityMode.AUTO)
        .row_height(0.9)
        .merge_values(True)
        .align_value(common.TimelineValueAlignment.LEFT)
        .legend(legend)
        .tooltip(common_builders.VizTooltipOptions().mode(common.TooltipDisplayMode.SINGLE).sort(common.SortOrder.NONE))
    )


_KINDS: dict[str, Callable[[Panel], Any]] = {
    "timeseries": _timeseries,
    "stat": _stat,
    "table": _table,
    "heatmap": _heatmap,
    "state-timeline": _state_timeline,
}
