#include "client/kvctl_format.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

namespace triax::kvctl {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

TEST(EnumNames, StripPrefixAndLowerCase) {
  EXPECT_EQ(RoleName(triax::v1::ROLE_TOOL_CALL), "tool_call");
  EXPECT_EQ(FormatName(triax::v1::FORMAT_INT2), "int2");
  EXPECT_EQ(TierName(triax::v1::TIER_HOST), "host");
  EXPECT_EQ(WorkerStateName(triax::v1::WORKER_STATE_DOWN), "down");
  EXPECT_EQ(WorkerStateName(triax::v1::WORKER_STATE_SUSPECT), "suspect");
  EXPECT_EQ(EventKindName(triax::v1::EVENT_WORKER_RECOVERED),
            "WORKER_RECOVERED");
  EXPECT_EQ(SequenceStateName(triax::v1::SEQUENCE_STATE_LOST), "lost");
  EXPECT_EQ(EventKindName(triax::v1::EVENT_SEQUENCE_LOST), "SEQUENCE_LOST");
  EXPECT_EQ(FormatName(triax::v1::FORMAT_UNSPECIFIED), "-");
  EXPECT_EQ(RoleName(static_cast<triax::v1::Role>(77)), "?77");
}

TEST(TagString, JoinsThreeAxes) {
  triax::v1::Tag tag;
  tag.set_temporal(triax::v1::TEMPORAL_SINK);
  tag.set_modality(triax::v1::MODALITY_TEXT);
  tag.set_role(triax::v1::ROLE_SYSTEM);
  EXPECT_EQ(TagString(tag), "sink/text/system");
}

TEST(HumanBytes, Units) {
  EXPECT_EQ(HumanBytes(0), "0 B");
  EXPECT_EQ(HumanBytes(1023), "1023 B");
  EXPECT_EQ(HumanBytes(1536), "1.50 KiB");
  EXPECT_EQ(HumanBytes(12ull << 20), "12.00 MiB");
  EXPECT_EQ(HumanBytes(3ull << 30), "3.00 GiB");
}

TEST(UnixMsString, Rfc3339Utc) {
  EXPECT_EQ(UnixMsString(0), "-");
  EXPECT_EQ(UnixMsString(1700000000123), "2023-11-14T22:13:20.123Z");
}

TEST(Table, AlignsColumnsWithoutTrailingBlanks) {
  Table t({"A", "LONGER"});
  t.AddRow({"xyz", "1"});
  t.AddRow({"q"});
  EXPECT_EQ(t.Render(),
            "A    LONGER\n"
            "xyz  1\n"
            "q\n");
}

TEST(EventLine, KeyValueSkipsEmptyFields) {
  triax::v1::Event e;
  e.set_id(7);
  e.set_kind(triax::v1::EVENT_SEQUENCE_LOST);
  e.set_sequence_id("s-1");
  e.set_worker_id("w1");
  e.add_lineage_ids(4);
  e.add_lineage_ids(5);
  e.set_detail("reason=\"worker down\"");
  const std::string line = EventLine(e);
  EXPECT_THAT(line, HasSubstr("id=7 "));
  EXPECT_THAT(line, HasSubstr("kind=SEQUENCE_LOST"));
  EXPECT_THAT(line, HasSubstr("sequence=s-1"));
  EXPECT_THAT(line, HasSubstr("worker=w1"));
  EXPECT_THAT(line, HasSubstr("lineages=4,5"));
  EXPECT_THAT(line, HasSubstr(R"(detail="reason=\"worker down\"")"));
  EXPECT_THAT(line, Not(HasSubstr("tenant=")));
  EXPECT_THAT(line, Not(HasSubstr("lineage=")));
  EXPECT_THAT(line, Not(HasSubstr("format=")));
}

TEST(EventJson, EveryFieldEscaped) {
  triax::v1::Event e;
  e.set_id(3);
  e.set_unix_ms(42);
  e.set_kind(triax::v1::EVENT_BLOCK_CREATED);
  e.set_lineage_id(9);
  e.set_tenant_id("t\"1");
  e.mutable_tag()->set_temporal(triax::v1::TEMPORAL_CURRENT_TURN);
  e.mutable_tag()->set_modality(triax::v1::MODALITY_TEXT);
  e.mutable_tag()->set_role(triax::v1::ROLE_USER);
  e.set_format(triax::v1::FORMAT_INT4);
  e.set_detail("a\nb");
  EXPECT_EQ(EventJson(e),
            R"({"id":3,"unix_ms":42,"kind":"BLOCK_CREATED","lineage_id":9,)"
            R"("sequence_id":"","tenant_id":"t\"1","worker_id":"",)"
            R"("source_worker_id":"",)"
            R"("tag":{"temporal":"current_turn","modality":"text",)"
            R"("role":"user"},"format":"int4","lineage_ids":[],)"
            R"("detail":"a\nb"})");
}

TEST(JsonString, ControlCharacters) {
  EXPECT_EQ(JsonString(std::string("x\x01y\\", 4)), R"("x\u0001y\\")");
}

TEST(SequenceDetail, ShowsPlanAndLostLineages) {
  triax::v1::SequenceInfo s;
  s.set_sequence_id("seq-9");
  s.set_tenant_id("acme");
  s.set_state(triax::v1::SEQUENCE_STATE_LOST);
  s.set_block_tokens(16);
  s.set_num_tokens(20);
  for (int i = 0; i < 2; ++i) {
    auto* b = s.add_blocks();
    b->set_index(i);
    b->set_lineage_id(100 + i);
    b->set_first_token(size_t{16} * i);
    b->set_num_tokens(i == 0 ? 16 : 4);
    b->set_capacity(16);
    b->set_format(triax::v1::FORMAT_BF16);
    b->set_refcount(1);
    s.add_lost_lineage_ids(100 + i);
  }
  const std::string out = SequenceDetail(s);
  EXPECT_THAT(out, HasSubstr("seq-9"));
  EXPECT_THAT(out, HasSubstr("lost lineages:  100,101"));
  EXPECT_THAT(out, HasSubstr("20 in 2 blocks of 16"));
  EXPECT_THAT(out, HasSubstr("1      101      16     4/16"));
}

TEST(SequenceDetail, NoLostLineagesWhenOpen) {
  triax::v1::SequenceInfo s;
  s.set_state(triax::v1::SEQUENCE_STATE_OPEN);
  EXPECT_THAT(SequenceDetail(s), Not(HasSubstr("lost")));
}

TEST(SequenceDetail, ShowsAReusedPrefix) {
  triax::v1::SequenceInfo s;
  s.set_state(triax::v1::SEQUENCE_STATE_OPEN);
  EXPECT_THAT(SequenceDetail(s), Not(HasSubstr("prefix:")));
  s.set_prefix_sequence_id("seq-3");
  s.set_prefix_blocks(2);
  s.set_prefix_tokens(32);
  s.set_hashed_blocks(3);
  const std::string out = SequenceDetail(s);
  EXPECT_THAT(out, HasSubstr("2 blocks (32 tokens) of seq-3"));
  EXPECT_THAT(out, HasSubstr("3 blocks"));
}

TEST(PressureReport, ShowsThePrefixIndex) {
  triax::v1::GetPressureResponse r;
  r.set_prefix_index_blocks(7);
  r.set_prefix_hits(2);
  r.set_prefix_reused_blocks(5);
  EXPECT_THAT(PressureReport(r),
              HasSubstr("indexed_blocks=7 hits=2 reused_blocks=5"));
}

TEST(Encoding, ParsesShortAndKeyedForms) {
  triax::v1::BlockEncoding e;
  ASSERT_TRUE(ParseEncoding("tq3", &e).ok());
  EXPECT_EQ(e.format(), triax::v1::FORMAT_TQ3);
  EXPECT_EQ(e.format_v(), triax::v1::FORMAT_UNSPECIFIED);
  ASSERT_TRUE(ParseEncoding("k=fp8,v=int4,g=64,scale=fp8", &e).ok());
  EXPECT_EQ(e.format(), triax::v1::FORMAT_FP8_E4M3);
  EXPECT_EQ(e.format_v(), triax::v1::FORMAT_INT4);
  EXPECT_EQ(e.group_size(), 64u);
  EXPECT_EQ(e.scale_dtype(), triax::v1::SCALE_DTYPE_FP8_E4M3);
  EXPECT_EQ(
      EncodingString(e.format(), e.format_v(), e.group_size(), e.scale_dtype()),
      "k=fp8,v=int4,g=64,scale=fp8");
  EXPECT_EQ(
      EncodingString(triax::v1::FORMAT_INT4, triax::v1::FORMAT_UNSPECIFIED, 32,
                     triax::v1::SCALE_DTYPE_FP16),
      "int4");
  EXPECT_EQ(EncodingString(triax::v1::FORMAT_TQ2, triax::v1::FORMAT_TQ2, 0,
                           triax::v1::SCALE_DTYPE_UNSPECIFIED),
            "tq2");
  EXPECT_THAT(std::string(ParseEncoding("int3", &e).message()),
              HasSubstr("not a format"));
  EXPECT_THAT(std::string(ParseEncoding("v=int4", &e).message()),
              HasSubstr("k=FORMAT is required"));
  EXPECT_THAT(std::string(ParseEncoding("k=int4,x=1", &e).message()),
              HasSubstr("unknown key \"x\""));
  EXPECT_THAT(std::string(ParseEncoding("k=int4,scale=fp4", &e).message()),
              HasSubstr("bad value in \"scale=fp4\""));
}

TEST(CapacityRow, ParsesEachKindAndItsOptions) {
  auto rows = ParseCapacityRows(
      "policies",
      "bf16 k=int2,v=int2,g=32+label=kivi-2 policy=triaxial-static "
      "triaxial=3.5+dnll int4+sink=16+window=32");
  ASSERT_TRUE(rows.ok()) << rows.status();
  ASSERT_EQ(rows->size(), 5u);
  EXPECT_EQ((*rows)[0].format(), triax::v1::FORMAT_BF16);
  EXPECT_EQ((*rows)[1].format(), triax::v1::FORMAT_INT2);
  EXPECT_EQ((*rows)[1].group_size(), 32u);
  EXPECT_EQ((*rows)[1].label(), "kivi-2");
  EXPECT_EQ((*rows)[2].policy(), "triaxial-static");
  EXPECT_DOUBLE_EQ((*rows)[3].budget_bits(), 3.5);
  EXPECT_EQ((*rows)[3].objective(), triax::v1::OBJECTIVE_DNLL);
  EXPECT_EQ((*rows)[4].sink_tokens(), 16u);
  EXPECT_EQ((*rows)[4].window_tokens(), 32u);
  EXPECT_EQ(
      std::string(
          ParseCapacityRow("policies", "triaxial=lots").status().message()),
      "--policies=\"triaxial=lots\": triaxial=BITS needs a number");
  EXPECT_THAT(
      std::string(ParseCapacityRow("p", "int4+label=").status().message()),
      HasSubstr("unknown option \"label=\""));
  EXPECT_THAT(std::string(ParseCapacityRow("p", "int3").status().message()),
              HasSubstr("--p=\"int3\""));
}

TEST(PolicyRule, ParsesSelectorsAndRoundTrips) {
  triax::v1::PolicyRule r;
  ASSERT_TRUE(ParsePolicyRule("temporal=sink:bf16", &r).ok());
  EXPECT_EQ(r.temporal(), triax::v1::TEMPORAL_SINK);
  EXPECT_EQ(r.format(), triax::v1::FORMAT_BF16);
  ASSERT_TRUE(
      ParsePolicyRule("role=system,modality=image:k=int4,v=int2,g=64", &r)
          .ok());
  EXPECT_EQ(r.role(), triax::v1::ROLE_SYSTEM);
  EXPECT_EQ(r.modality(), triax::v1::MODALITY_IMAGE);
  EXPECT_EQ(r.format_v(), triax::v1::FORMAT_INT2);
  EXPECT_EQ(PolicyRuleString(r),
            "role=system,modality=image:k=int4,v=int2,g=64");
  ASSERT_TRUE(ParsePolicyRule("*:int4", &r).ok());
  EXPECT_EQ(r.temporal(), triax::v1::TEMPORAL_UNSPECIFIED);
  EXPECT_EQ(PolicyRuleString(r), "*:int4");
  ASSERT_TRUE(ParsePolicyRule("temporal=recent_turns:tq3", &r).ok());
  EXPECT_EQ(r.temporal(), triax::v1::TEMPORAL_RECENT_TURNS);
  EXPECT_THAT(std::string(ParsePolicyRule("role=boss:int4", &r).message()),
              HasSubstr("bad value in \"role=boss\""));
  EXPECT_THAT(std::string(ParsePolicyRule("colour=red:int4", &r).message()),
              HasSubstr("unknown selector \"colour\""));
  EXPECT_THAT(std::string(ParsePolicyRule("*:int9", &r).message()),
              HasSubstr("not a format"));
  triax::v1::ListPoliciesResponse list;
  auto* p = list.add_policies();
  p->set_name("mix");
  ASSERT_TRUE(ParsePolicyRule("temporal=sink:bf16", p->add_rules()).ok());
  ASSERT_TRUE(ParsePolicyRule("*:tq3", p->add_rules()).ok());
  const std::string table = PoliciesTable(list);
  EXPECT_THAT(table, HasSubstr("mix   no       0  temporal=sink:bf16"));
  EXPECT_THAT(table, HasSubstr("1  *:tq3"));
}

TEST(SequenceDetail, ShowsKvFormatsGroupAndScale) {
  triax::v1::SequenceInfo s;
  auto* b = s.add_blocks();
  b->set_format(triax::v1::FORMAT_FP8_E4M3);
  b->set_format_v(triax::v1::FORMAT_INT4);
  b->set_group_size(64);
  b->set_scale_dtype(triax::v1::SCALE_DTYPE_FP8_E4M3);
  b = s.add_blocks();
  b->set_format(triax::v1::FORMAT_TQ3);
  const std::string out = SequenceDetail(s);
  EXPECT_THAT(out, HasSubstr("K    V     GROUP  SCALE"));
  EXPECT_THAT(out, HasSubstr("fp8  int4  64     fp8"));
  EXPECT_THAT(out, HasSubstr("tq3  tq3   -      -"));
}

triax::v1::Event TransferEvent(uint64_t id, triax::v1::EventKind kind,
                               const std::string& from, const std::string& to,
                               const std::string& detail,
                               uint64_t lineage = 0) {
  triax::v1::Event e;
  e.set_id(id);
  e.set_unix_ms(1000 * id);
  e.set_kind(kind);
  e.set_sequence_id("seq-1");
  e.set_lineage_id(lineage);
  e.set_source_worker_id(from);
  e.set_worker_id(to);
  e.set_detail(detail);
  return e;
}

TEST(DetailValue, FindsKeysOnly) {
  EXPECT_EQ(DetailValue("transfer=xfer-2 blocks=3", "transfer"), "xfer-2");
  EXPECT_EQ(DetailValue("transfer=xfer-2 blocks=3", "blocks"), "3");
  EXPECT_EQ(DetailValue("transfer=xfer-2 blocks=3", "block"), "");
  EXPECT_EQ(DetailValue("", "transfer"), "");
}

TEST(EventLine, TransferEventsNameTheSource) {
  const std::string line = EventLine(TransferEvent(
      4, triax::v1::EVENT_SEQUENCE_TRANSFERRED, "wa", "wb", "transfer=xfer-1"));
  EXPECT_THAT(line, HasSubstr("kind=SEQUENCE_TRANSFERRED"));
  EXPECT_THAT(line, HasSubstr("worker=wb source=wa"));
  EXPECT_THAT(EventJson(TransferEvent(4, triax::v1::EVENT_TRANSFER_FAILED, "wa",
                                      "wb", "")),
              HasSubstr(R"("worker_id":"wb","source_worker_id":"wa")"));
  EXPECT_EQ(EventKindName(triax::v1::EVENT_BLOCK_TRANSFERRED),
            "BLOCK_TRANSFERRED");
}

TEST(TransferHistory, OneRowPerTransferEvent) {
  EXPECT_EQ(TransferHistory({}), "transfers: none\n");
  triax::v1::Event other;
  other.set_kind(triax::v1::EVENT_SEQUENCE_OPENED);
  EXPECT_EQ(TransferHistory({other}), "transfers: none\n");
  const std::string out = TransferHistory(
      {other,
       TransferEvent(5, triax::v1::EVENT_TRANSFER_STARTED, "wa", "wb",
                     "transfer=xfer-1 blocks=3"),
       TransferEvent(6, triax::v1::EVENT_TRANSFER_FAILED, "wa", "wb",
                     "transfer=xfer-1 code=DATA_LOSS error=crc"),
       TransferEvent(7, triax::v1::EVENT_TRANSFER_STARTED, "wa", "wb",
                     "transfer=xfer-2 blocks=3"),
       TransferEvent(8, triax::v1::EVENT_SEQUENCE_TRANSFERRED, "wa", "wb",
                     "transfer=xfer-2 wire_bytes=10")});
  EXPECT_THAT(out, HasSubstr("TRANSFER  EVENT"));
  EXPECT_THAT(out, HasSubstr("xfer-1    failed     wa    wb"));
  EXPECT_THAT(out, HasSubstr("xfer-2    committed  wa    wb"));
  EXPECT_EQ(std::count(out.begin(), out.end(), '\n'), 6);  // title, header, 4
}

TEST(TransferReport, WireAgainstBf16) {
  triax::v1::TransferSequenceResponse r;
  r.set_transfer_id("xfer-3");
  r.set_source_worker_id("prefill-0");
  r.set_destination_worker_id("decode-1");
  r.mutable_sequence()->set_sequence_id("seq-9");
  r.mutable_sequence()->set_worker_id("decode-1");
  r.set_blocks(4);
  r.set_pages(128);
  r.set_wire_bytes(1000);
  r.set_bf16_bytes(3500);
  r.set_source_bytes(3500);
  r.set_seconds(0.25);
  r.set_pull_seconds(0.2);
  r.set_data_path("ipc");
  const std::string out = TransferReport(r);
  EXPECT_THAT(out, HasSubstr("prefill-0 -> decode-1"));
  EXPECT_THAT(out, HasSubstr("4 (128 pages"));
  EXPECT_THAT(out, HasSubstr("0.286 (3.50x fewer bytes than BF16)"));
  EXPECT_THAT(out, HasSubstr("0.250 (pull 0.200)"));
  EXPECT_THAT(out, HasSubstr("data path:     ipc"));
  EXPECT_THAT(out, HasSubstr("decode-1 ("));  // the sequence's worker
  EXPECT_THAT(out, Not(HasSubstr("shared blocks:")));
  r.set_wire_bytes(0);
  EXPECT_THAT(TransferReport(r), HasSubstr("wire / bf16:   -"));
  r.set_shared_blocks(2);
  EXPECT_THAT(TransferReport(r),
              HasSubstr("shared blocks:  2 (blocks [0, 2) shared with the "
                        "destination's prefix sequence; not moved)"));
}

TEST(WorkerPath, NodeByNode) {
  triax::v1::QueryTraceResponse t;
  EXPECT_EQ(WorkerPath(t), "-");
  triax::v1::Event created;
  created.set_kind(triax::v1::EVENT_BLOCK_CREATED);
  created.set_worker_id("wa");
  *t.add_events() = created;
  *t.add_events() = TransferEvent(3, triax::v1::EVENT_BLOCK_TRANSFERRED, "wa",
                                  "wb", "transfer=xfer-1 index=0", 5);
  *t.add_events() = TransferEvent(9, triax::v1::EVENT_BLOCK_TRANSFERRED, "wb",
                                  "wa", "transfer=xfer-4 index=0", 5);
  EXPECT_EQ(WorkerPath(t),
            "created on wa, transferred wa -> wb (xfer-1), transferred wb -> "
            "wa (xfer-4)");
  const std::string trace = TraceDetail(5, t);
  EXPECT_THAT(trace, HasSubstr("path:"));
  EXPECT_THAT(trace, HasSubstr("wa -> wb"));
  // The creation is no longer retained: the path starts at the source.
  t.mutable_events()->DeleteSubrange(0, 1);
  EXPECT_EQ(WorkerPath(t),
            "on wa, transferred wa -> wb (xfer-1), transferred wb -> wa "
            "(xfer-4)");
  // A shared block copied to wb, then a prefix hit there.
  triax::v1::QueryTraceResponse u;
  *u.add_events() = created;
  *u.add_events() =
      TransferEvent(3, triax::v1::EVENT_BLOCK_TRANSFERRED, "wa", "wb",
                    "transfer=xfer-1 index=0 from=bf16 copy=true", 5);
  triax::v1::Event hit =
      TransferEvent(7, triax::v1::EVENT_BLOCK_TRANSFERRED, "wa", "wb",
                    "transfer=xfer-2 index=0 shared=true prefix=seq-1", 5);
  hit.set_sequence_id("seq-2");
  *u.add_events() = hit;
  EXPECT_EQ(WorkerPath(u),
            "created on wa, copied wa -> wb (xfer-1), shared on wb by seq-2 "
            "(xfer-2)");
}

TEST(SequenceDetail, ShowsATransferInFlight) {
  triax::v1::SequenceInfo s;
  s.set_sequence_id("seq-1");
  s.set_worker_id("wa");
  EXPECT_THAT(SequenceDetail(s), Not(HasSubstr("transfer:")));
  s.set_transfer_id("xfer-2");
  s.set_transfer_destination_worker_id("wb");
  EXPECT_THAT(SequenceDetail(s),
              HasSubstr("transfer:  xfer-2 to wb in flight"));
}

}  // namespace
}  // namespace triax::kvctl

namespace triax::kvctl {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

TEST(SequenceDetail, ShowsTierAndEvicted) {
  triax::v1::SequenceInfo s;
  auto* a = s.add_blocks();
  a->set_lineage_id(1);
  a->set_format(triax::v1::FORMAT_BF16);
  a->set_refcount(1);  // tier unspecified: on the device
  auto* b = s.add_blocks();
  b->set_lineage_id(2);
  b->set_format(triax::v1::FORMAT_BF16);
  b->set_refcount(1);
  b->set_tier(triax::v1::TIER_DISK);
  auto* c = s.add_blocks();
  c->set_lineage_id(3);
  c->set_format(triax::v1::FORMAT_BF16);
  c->set_refcount(1);
  c->set_tier(triax::v1::TIER_DEVICE);
  c->set_evicted(true);
  const std::string out = SequenceDetail(s);
  EXPECT_THAT(out, HasSubstr("REFCOUNT  TIER    EVICTED"));
  EXPECT_THAT(out, HasSubstr("1         device  no"));
  EXPECT_THAT(out, HasSubstr("1         disk    no"));
  EXPECT_THAT(out, HasSubstr("1         device  yes"));
}

TEST(PressureActionName, Short) {
  EXPECT_EQ(PressureActionName(triax::v1::PRESSURE_ACTION_SPILL_HOST),
            "spill_host");
  EXPECT_EQ(PressureActionName(triax::v1::PRESSURE_ACTION_EVICT), "evict");
  EXPECT_EQ(PressureActionName(triax::v1::PRESSURE_ACTION_UNSPECIFIED), "-");
}

triax::v1::GetPressureResponse SamplePressure() {
  triax::v1::GetPressureResponse r;
  r.set_mode("demote-first");
  r.set_snapshot_blocks(1234);
  r.set_snapshot_age_ms(12.5);
  r.set_ranking_ms(0.4567);
  r.set_demotions(3);
  r.set_spills(2);
  r.set_restores(1);
  r.set_evictions(0);
  auto* p = r.add_pools();
  p->set_worker_id("w0");
  p->set_tier(triax::v1::TIER_DEVICE);
  p->set_capacity_bytes(100 << 20);
  p->set_used_bytes(95 << 20);
  p->set_high_watermark_bytes(90 << 20);
  p->set_low_watermark_bytes(80 << 20);
  auto* h = r.add_pools();
  h->set_worker_id("w0");
  h->set_tier(triax::v1::TIER_HOST);
  h->set_capacity_bytes(200 << 20);
  h->set_used_bytes(170 << 20);
  h->set_high_watermark_bytes(180 << 20);
  h->set_low_watermark_bytes(160 << 20);
  auto* t = r.add_tenants();
  t->set_tenant_id("acme");
  auto* b = t->add_budgets();
  b->set_tier(triax::v1::TIER_DEVICE);
  b->set_floor_bytes(10 << 20);
  b->set_ceiling_bytes(50 << 20);
  auto* u = t->add_usage();
  u->set_tier(triax::v1::TIER_DEVICE);
  u->set_used_bytes(60 << 20);
  auto* uh = t->add_usage();
  uh->set_tier(triax::v1::TIER_HOST);
  uh->set_used_bytes(1 << 20);
  auto* t2 = r.add_tenants();
  t2->set_tenant_id("beta");
  auto* b2 = t2->add_budgets();
  b2->set_tier(triax::v1::TIER_DEVICE);
  b2->set_floor_bytes(10 << 20);
  b2->set_ceiling_bytes(50 << 20);
  auto* u2 = t2->add_usage();
  u2->set_tier(triax::v1::TIER_DEVICE);
  u2->set_used_bytes(12 << 20);
  auto* a = r.add_ranked();
  a->set_lineage_id(17);
  a->set_sequence_id("seq-3");
  a->set_tenant_id("acme");
  a->set_action(triax::v1::PRESSURE_ACTION_DEMOTE);
  a->mutable_encoding()->set_format(triax::v1::FORMAT_INT4);
  a->mutable_encoding()->set_format_v(triax::v1::FORMAT_INT2);
  a->mutable_encoding()->set_group_size(64);
  a->set_bytes_freed(36864);
  a->set_cost(1.25e-7);
  auto* e = r.add_ranked();
  e->set_lineage_id(18);
  e->set_sequence_id("seq-3");
  e->set_tenant_id("acme");
  e->set_action(triax::v1::PRESSURE_ACTION_EVICT);
  e->set_bytes_freed(98304);
  e->set_cost(0.003);
  return r;
}

TEST(PressureReport, ShowsEverySection) {
  const std::string out = PressureReport(SamplePressure());
  EXPECT_THAT(out, HasSubstr("mode:      demote-first"));
  EXPECT_THAT(out,
              HasSubstr("1234 blocks, 12.5 ms old; ranking took 0.457 ms"));
  EXPECT_THAT(out, HasSubstr("demotions=3 spills=2 restores=1 evictions=0"));
  // Pools: used, capacity, use, watermarks and state.
  EXPECT_THAT(out, HasSubstr("WORKER  TIER    USED        CAPACITY    USE"));
  EXPECT_THAT(out, HasSubstr("w0      device  95.00 MiB   100.00 MiB  95.0%  "
                             "80.00 MiB   90.00 MiB   over high"));
  EXPECT_THAT(out, HasSubstr("w0      host    170.00 MiB  200.00 MiB  85.0%  "
                             "160.00 MiB  180.00 MiB  above low"));
  // Tenants: one row per tier with a budget or usage.
  EXPECT_THAT(out, HasSubstr("acme    device  60.00 MiB  10.00 MiB  "
                             "50.00 MiB  over ceiling by 10.00 MiB"));
  EXPECT_THAT(out, HasSubstr("acme    host    1.00 MiB   -          -"
                             "          no budget"));
  EXPECT_THAT(out, HasSubstr("beta    device  12.00 MiB  10.00 MiB  "
                             "50.00 MiB  above floor by 2.00 MiB"));
  // Ranked: demote shows its new encoding, evict none.
  EXPECT_THAT(out, HasSubstr("RANKED (2, cheapest first)"));
  EXPECT_THAT(out, HasSubstr("1  17       seq-3     acme    demote  "
                             "k=int4,v=int2,g=64  36.00 KiB    1.25e-07"));
  EXPECT_THAT(out, HasSubstr("2  18       seq-3     acme    evict   -"
                             "                   96.00 KiB    0.003"));
}

TEST(PressureReport, EmptyResponseHasHeadersOnly) {
  const std::string out = PressureReport(triax::v1::GetPressureResponse());
  EXPECT_THAT(out, HasSubstr("mode:      -"));
  EXPECT_THAT(out, HasSubstr("RANKED (0, cheapest first)"));
  EXPECT_THAT(out, Not(HasSubstr("over high")));
  EXPECT_THAT(out, HasSubstr("TENANT  TIER  USED  FLOOR  CEILING  STANDING"));
}

}  // namespace
TEST(WorkersTable, ShowsFramesFragmentationAndPools) {
  triax::v1::ListWorkersResponse resp;
  auto* w = resp.add_workers();
  w->set_worker_id("w1");
  w->set_state(triax::v1::WORKER_STATE_UP);
  auto* inv = w->mutable_inventory();
  inv->set_frame_bytes(256 << 10);
  inv->set_frames(188);
  inv->set_free_frames(12);
  inv->set_free_frames_compacted(20);
  inv->set_fragmentation(0.25);
  inv->set_compactions(3);
  inv->set_pages_moved(41);
  auto* p = inv->add_pools();
  p->set_format(triax::v1::FORMAT_INT4);
  p->set_format_v(triax::v1::FORMAT_INT2);
  p->set_group_size(64);
  p->set_page_bytes(4608);
  p->set_pages_per_frame(56);
  p->set_frames(3);
  p->set_pages_used(150);
  p->set_free_slots(18);
  p->set_allocatable_pages(690);
  p->set_free_slots_compacted(18);
  const std::string workers = WorkersTable(resp);
  EXPECT_THAT(workers, HasSubstr("12/188 x 256.00 KiB (20 compacted)"));
  EXPECT_THAT(workers, HasSubstr("25.0%"));
  EXPECT_THAT(workers, HasSubstr("3/41p"));
  const std::string pools = PoolsTable(resp);
  EXPECT_THAT(pools, HasSubstr("int4/int2 g64"));
  EXPECT_THAT(pools, HasSubstr("3 x 56p"));
  EXPECT_THAT(pools, HasSubstr("690"));
}

}  // namespace triax::kvctl
