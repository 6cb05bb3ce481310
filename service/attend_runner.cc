#include "service/attend_runner.h"

#include <cmath>
#include <cstdint>
#include <optional>
#include <string>

#include "absl/strings/str_cat.h"
#include "google/protobuf/descriptor.h"
#include "google/protobuf/io/coded_stream.h"
#include "google/protobuf/io/zero_copy_stream_impl_lite.h"
#include "google/protobuf/wire_format_lite.h"
#include "grpcpp/support/proto_buffer_reader.h"

namespace kvpool {
namespace {

// Fields the parse would keep as unknown fields, each one an allocation: a request may carry a
// few (a newer client's), not millions.
constexpr size_t kMaxUnknownFields = 1024;

struct WireCount {
  size_t items = 0;
  size_t unknown = 0;
  bool malformed = false;  // an item that is not an AttendItem, or a group (none is a field here)
};

// The wire type each field number of a message takes (-1: no such field), from its descriptor:
// a table for the low numbers, which every field of these messages has, so that the scan looks
// nothing up per field.
class FieldWireTypes {
 public:
  explicit FieldWireTypes(const google::protobuf::Descriptor& type) : type_(type) {
    for (int& w : low_) w = -1;
    for (int i = 0; i < type.field_count(); ++i) {
      if (type.field(i)->number() < kLow) low_[type.field(i)->number()] = Of(*type.field(i));
    }
  }
  int operator()(int number) const {
    if (number < kLow) return low_[number];
    const google::protobuf::FieldDescriptor* field = type_.FindFieldByNumber(number);
    return field == nullptr ? -1 : Of(*field);
  }

 private:
  static constexpr int kLow = 32;
  static int Of(const google::protobuf::FieldDescriptor& field) {
    using google::protobuf::internal::WireFormatLite;
    return WireFormatLite::WireTypeForFieldType(
        static_cast<WireFormatLite::FieldType>(field.type()));
  }
  const google::protobuf::Descriptor& type_;
  int low_[kLow];
};

// Reads the fields of an AttendRequest (`items` set: their field number) or an AttendItem
// (`items` 0) up to its end or the current limit, counting items (each scanned in turn) and
// unknown fields into `*count`; false when the bytes are not a message at all. Nothing is
// allocated, whatever the bytes.
bool ScanFields(google::protobuf::io::CodedInputStream& coded, const FieldWireTypes& wire_types,
                int items, WireCount* count) {
  using google::protobuf::internal::WireFormatLite;
  static const FieldWireTypes item_wire_types(*v1::AttendItem::descriptor());
  for (uint32_t tag = coded.ReadTag(); tag != 0; tag = coded.ReadTag()) {
    const int number = WireFormatLite::GetTagFieldNumber(tag);
    const int wire_type = WireFormatLite::GetTagWireType(tag);
    const bool known = wire_types(number) == wire_type;
    if (known && items != 0 && number == items) {
      ++count->items;
      uint32_t length = 0;
      if (!coded.ReadVarint32(&length)) return false;
      const auto limit = coded.PushLimit(static_cast<int>(length));
      if (!ScanFields(coded, item_wire_types, 0, count) || !coded.ConsumedEntireMessage()) {
        count->malformed = true;
        if (!coded.Skip(coded.BytesUntilLimit())) return false;
      }
      coded.PopLimit(limit);
      continue;
    }
    if (wire_type == WireFormatLite::WIRETYPE_START_GROUP ||
        wire_type == WireFormatLite::WIRETYPE_END_GROUP) {
      count->malformed = true;
    }
    if (!known) ++count->unknown;
    if (!WireFormatLite::SkipField(&coded, tag)) return false;
  }
  return coded.ConsumedEntireMessage();
}

// The items, unknown fields and malformed parts on the wire that `in` reads, or nullopt when its
// bytes are not a message.
std::optional<WireCount> CountFields(google::protobuf::io::ZeroCopyInputStream* in) {
  static const FieldWireTypes request_wire_types(*v1::AttendRequest::descriptor());
  google::protobuf::io::CodedInputStream coded(in);
  WireCount count;
  if (!ScanFields(coded, request_wire_types, v1::AttendRequest::kItemsFieldNumber, &count)) {
    return std::nullopt;
  }
  return count;
}

}  // namespace

absl::Status AttendRunner::Parse(std::string_view wire, v1::AttendRequest* request) const {
  const int size = static_cast<int>(wire.size());
  google::protobuf::io::ArrayInputStream count(wire.data(), size), parse(wire.data(), size);
  return ParseFrom(&count, &parse, request);
}

absl::Status AttendRunner::Parse(grpc::ByteBuffer* wire, v1::AttendRequest* request) const {
  grpc::ProtoBufferReader count(wire), parse(wire);
  return ParseFrom(&count, &parse, request);
}

absl::Status AttendRunner::ParseFrom(google::protobuf::io::ZeroCopyInputStream* count,
                                     google::protobuf::io::ZeroCopyInputStream* parse,
                                     v1::AttendRequest* request) const {
  const absl::Status not_a_request = absl::InvalidArgumentError(
      absl::StrCat("the request is not an AttendRequest (or holds a group, or over ",
                   kMaxUnknownFields, " unknown fields)"));
  const std::optional<WireCount> fields = CountFields(count);
  if (!fields.has_value()) return not_a_request;
  if (absl::Status s = store_->CheckAttendBatch(fields->items); !s.ok()) return s;
  if (fields->malformed || fields->unknown > kMaxUnknownFields) return not_a_request;
  if (!request->ParseFromZeroCopyStream(parse)) return not_a_request;
  return absl::OkStatus();
}

absl::Status AttendRunner::ResolveGeometry(uint64_t lease_id) {
  if (geometry_valid_ && geometry_lease_ == lease_id) return absl::OkStatus();
  absl::StatusOr<KvStore::LeaseView> lease = store_->DescribeLease(lease_id);
  if (!lease.ok()) return lease.status();
  geometry_lease_ = lease_id;
  geometry_valid_ = true;
  num_kv_heads_ = lease->info.config.num_kv_heads;
  head_dim_ = lease->info.config.head_dim;
  return absl::OkStatus();
}

absl::Status AttendRunner::Run(const v1::AttendRequest& request, v1::AttendResponse* response) {
  return Step(request, nullptr, response);
}

absl::Status AttendRunner::RunInRegion(const v1::AttendRequest& request,
                                       const attend_socket::SharedRegion& region,
                                       v1::AttendResponse* response) {
  return Step(request, &region, response);
}

absl::Status AttendRunner::Step(const v1::AttendRequest& request,
                                const attend_socket::SharedRegion* region,
                                v1::AttendResponse* response) {
  response->Clear();
  response->set_server_draining(draining_ != nullptr && draining_->load(std::memory_order_relaxed));
  const int n = request.items_size();
  if (n == 0) return absl::InvalidArgumentError("Attend needs at least one item");
  // Before items_ is sized by it: a runner kept for many calls keeps that capacity.
  if (absl::Status s = store_->CheckAttendBatch(n); !s.ok()) return s;
  if (request.num_q_heads() == 0) return absl::InvalidArgumentError("num_q_heads is 0");
  const v1::OutputDtype out_dtype = request.output_dtype();
  if (out_dtype != v1::OUTPUT_DTYPE_UNSPECIFIED && out_dtype != v1::OUTPUT_DTYPE_FP16 &&
      out_dtype != v1::OUTPUT_DTYPE_FP32) {
    return absl::InvalidArgumentError("unknown OutputDtype");
  }
  if (absl::Status s = ResolveGeometry(request.items(0).lease_id()); !s.ok()) return s;
  const size_t q_values = static_cast<size_t>(request.num_q_heads()) * head_dim_;
  const size_t kv_bytes = static_cast<size_t>(num_kv_heads_) * head_dim_ * 2;
  const bool fp32 = out_dtype == v1::OUTPUT_DTYPE_FP32;
  const size_t out_item_bytes = q_values * (fp32 ? sizeof(float) : sizeof(uint16_t));

  // Region requests: where the step's arrays sit, checked against the region's size.
  attend_socket::RegionStepLayout layout;
  if (region != nullptr) {
    int appending = 0;
    for (const v1::AttendItem& in : request.items()) {
      if (!in.q().empty() || !in.new_k().empty() || !in.new_v().empty()) {
        return absl::InvalidArgumentError(
            "a region request carries q, new_k and new_v in the region, not in the message");
      }
      appending += in.append_in_region() ? 1 : 0;
    }
    // The sizes the client laid the arrays out with must be the namespace's: the region itself
    // tells nothing.
    if (request.region_q_bytes() != q_values * 2 ||
        (appending > 0 && request.region_kv_bytes() != kv_bytes)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "region request laid out with ", request.region_q_bytes(), " bytes of q and ",
          request.region_kv_bytes(), " of new_k / new_v per item; ", request.num_q_heads(),
          " q heads and ", num_kv_heads_, " KV heads x ", head_dim_, " dims fp16 need ",
          q_values * 2, " and ", kv_bytes));
    }
    const std::optional<attend_socket::RegionStepLayout> l =
        attend_socket::LayoutRegionStep(n, appending, q_values * 2, kv_bytes, out_item_bytes);
    if (!l.has_value() || l->end > region->size()) {
      return absl::InvalidArgumentError(
          absl::StrCat("the step's arrays (", n, " items, ", appending, " appending) need ",
                       l.has_value() ? absl::StrCat(l->end) : "more than 2^64", " bytes of the ",
                       region->size(), "-byte region"));
    }
    layout = *l;
  }

  items_.resize(n);
  int appended = 0;
  for (int i = 0; i < n; ++i) {
    const v1::AttendItem& in = request.items(i);
    KvStore::AttendItem& item = items_[i];
    item.lease_id = in.lease_id();
    item.new_token_id = in.new_token_id();
    if (region != nullptr) {
      item.q = reinterpret_cast<const uint16_t*>(region->data() + layout.q) + i * q_values;
      const size_t kv_offset = static_cast<size_t>(appended) * kv_bytes;
      item.new_k =
          in.append_in_region()
              ? reinterpret_cast<const uint16_t*>(region->data() + layout.new_k + kv_offset)
              : nullptr;
      item.new_v =
          in.append_in_region()
              ? reinterpret_cast<const uint16_t*>(region->data() + layout.new_v + kv_offset)
              : nullptr;
      appended += in.append_in_region() ? 1 : 0;
      continue;
    }
    if (in.append_in_region()) {
      return absl::InvalidArgumentError(
          absl::StrCat("item ", i, ": append_in_region is for AttendSocket region requests"));
    }
    if (in.q().size() != q_values * 2) {
      return absl::InvalidArgumentError(absl::StrCat("item ", i, ": q has ", in.q().size(),
                                                     " bytes; ", request.num_q_heads(), " heads x ",
                                                     head_dim_, " dims fp16 need ", q_values * 2));
    }
    const bool has_k = !in.new_k().empty();
    if (has_k != !in.new_v().empty()) {
      return absl::InvalidArgumentError(absl::StrCat("item ", i, ": new_k and new_v go together"));
    }
    if (has_k && (in.new_k().size() != kv_bytes || in.new_v().size() != kv_bytes)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "item ", i, ": new_k/new_v have ", in.new_k().size(), "/", in.new_v().size(), " bytes; ",
          num_kv_heads_, " heads x ", head_dim_, " dims fp16 need ", kv_bytes));
    }
    item.q = reinterpret_cast<const uint16_t*>(in.q().data());
    item.new_k = has_k ? reinterpret_cast<const uint16_t*>(in.new_k().data()) : nullptr;
    item.new_v = has_k ? reinterpret_cast<const uint16_t*>(in.new_v().data()) : nullptr;
  }

  void* out_data;
  if (region != nullptr) {
    out_data = region->data() + layout.out;
  } else {
    std::string* out = response->mutable_out();
    out->resize(out_item_bytes * n);
    out_data = out->data();
  }
  if (reinterpret_cast<uintptr_t>(out_data) % alignof(float) != 0) {
    return absl::InternalError("response buffer is not aligned for its values");
  }
  KvStore::AttendOutputs outputs;
  if (fp32) {
    outputs.out = static_cast<float*>(out_data);
  } else {
    outputs.out_fp16 = static_cast<uint16_t*>(out_data);
  }
  if (request.return_lse()) {
    response->mutable_lse()->Resize(static_cast<int>(request.num_q_heads()) * n, 0.0f);
    outputs.lse = response->mutable_lse()->mutable_data();
  }
  response->mutable_context_tokens()->Resize(n, 0);
  outputs.context_tokens = response->mutable_context_tokens()->mutable_data();
  const float sm_scale = request.sm_scale() != 0.0f
                             ? request.sm_scale()
                             : 1.0f / std::sqrt(static_cast<float>(head_dim_));
  if (absl::Status s =
          store_->Attend(request.layer(), request.num_q_heads(), sm_scale, items_, outputs);
      !s.ok()) {
    response->Clear();
    return s;
  }
  return absl::OkStatus();
}

}  // namespace kvpool
