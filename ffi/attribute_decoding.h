// Decoding of jfm::Attributes (attention_ffi.h) from a call's attributes dictionary in constant
// time per attribute. XLA's struct decoding (XLA_FFI_REGISTER_STRUCT_ATTR_DECODING) looks up
// every member by name with a linear scan of the dictionary, about 170 string comparisons per
// call for our 18 attributes. XLA passes a call frame's attributes sorted by name (the
// comment on Handler::attrs_idx_ in xla/ffi/api/api.h), so each member is read at its position
// in that order, computed once, and only its name is compared; a dictionary in any other order
// is still decoded, member by member by name. Either way a missing, extra, misnamed or mistyped
// attribute is an error, as with XLA's struct decoding. Include once, from attention_ffi.cc.
#ifndef JAX_FLASH_METAL_ATTRIBUTE_DECODING_H_
#define JAX_FLASH_METAL_ATTRIBUTE_DECODING_H_

#include <algorithm>
#include <array>
#include <cstddef>
#include <optional>
#include <string_view>

#include "attention_ffi.h"
#include "host_timing.h"
#include "xla/ffi/api/ffi.h"

namespace jfm {

// Decodes one attribute into its member of `out`; false (with the diagnostic) on a wrong type.
using AttributeDecoder = bool (*)(XLA_FFI_AttrType type, void* attr,
                                  xla::ffi::DiagnosticEngine& diagnostic, Attributes* out);

struct AttributeMember {
  std::string_view name;
  AttributeDecoder decode;
};

// JFM_FFI_ATTRIBUTES's members, sorted by name: the order of a call frame's attributes.
inline const std::array<AttributeMember, kAttributeCount>& sorted_attribute_members() {
  static const std::array<AttributeMember, kAttributeCount> members = [] {
    std::array<AttributeMember, kAttributeCount> m = {{
#define JFM_ATTRIBUTE_DECODER(type, member)                                               \
  {#member, [](XLA_FFI_AttrType t, void* a, xla::ffi::DiagnosticEngine& d, Attributes* out) { \
     std::optional<type> value = xla::ffi::AttrDecoding<type>::Decode(t, a, d);           \
     if (value.has_value()) out->member = *value;                                         \
     return value.has_value();                                                            \
   }},
        JFM_FFI_ATTRIBUTES(JFM_ATTRIBUTE_DECODER)
#undef JFM_ATTRIBUTE_DECODER
    }};
    std::sort(m.begin(), m.end(), [](const AttributeMember& a, const AttributeMember& b) {
      return a.name < b.name;
    });
    return m;
  }();
  return members;
}

}  // namespace jfm

template <>
struct xla::ffi::AttrDecoding<jfm::Attributes> {
  using Type = jfm::Attributes;
  static std::optional<jfm::Attributes> Decode(XLA_FFI_AttrType type, void* attr,
                                               DiagnosticEngine& diagnostic) {
    jfm::mark_host_call_start();
    if (type != XLA_FFI_AttrType_DICTIONARY) {
      diagnostic.Emit("Wrong attribute type: expected ")
          << XLA_FFI_AttrType_DICTIONARY << " but got " << type;
      return std::nullopt;
    }
    const auto* attrs = static_cast<const XLA_FFI_Attrs*>(attr);
    const auto& members = jfm::sorted_attribute_members();
    if (static_cast<size_t>(attrs->size) != members.size()) {
      diagnostic.Emit("Wrong number of attributes: expected ")
          << members.size() << " attributes but got " << attrs->size;
      return std::nullopt;
    }
    auto name_at = [&](size_t i) {
      return std::string_view(attrs->names[i]->ptr, attrs->names[i]->len);
    };
    jfm::Attributes out{};
    for (size_t k = 0; k < members.size(); ++k) {
      size_t i = k;  // where the member is: its sorted position, else found by name
      if (name_at(i) != members[k].name) {
        for (i = 0; i < members.size() && name_at(i) != members[k].name; ++i) {
        }
        if (i == members.size()) {
          diagnostic.Emit("Missing attribute: ") << members[k].name;
          return std::nullopt;
        }
      }
      if (!members[k].decode(attrs->types[i], attrs->attrs[i], diagnostic, &out)) {
        return std::nullopt;
      }
    }
    return out;
  }
};

#endif  // JAX_FLASH_METAL_ATTRIBUTE_DECODING_H_
