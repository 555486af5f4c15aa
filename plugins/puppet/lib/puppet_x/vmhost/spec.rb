# frozen_string_literal: true

module PuppetX
  module Vmhost
    # Members of the spec's nested objects that vmhostd leaves out of its views while they have
    # their default, so a declared default compares equal to a view without it (no perpetual
    # change). Used by Spec.comparable, for `nics`, `boot` and `disks`.
    module SpecDefaults
      # A NIC's members at the values they have when not given (`queues` 1, `mode` bridge,
      # `trunk` false).
      NIC = { 'queues' => 1, 'mode' => 'bridge', 'trunk' => false }.freeze

      # `boot`'s members at the values they have when not given (`firmware` bios,
      # `secure_boot` false).
      BOOT = { 'firmware' => 'bios', 'secure_boot' => false }.freeze

      # A data disk's members at the values they have when not given (`snapshot` true: the
      # disk is in the VM's snapshots).
      DISK = { 'snapshot' => true }.freeze

      # HASH as vmhostd echoes it: the members of DEFAULTS left out at their default (a
      # boolean default also matches 'true' / 'false' and :true / :false); anything but a hash
      # unchanged.
      def self.strip(hash, defaults)
        return hash unless hash.is_a?(Hash)

        hash.reject do |k, v|
          next false unless defaults.key?(k)

          default = defaults[k]
          [true, false].include?(default) ? v.to_s == default.to_s : default == v
        end
      end
    end

    # Turning declared attributes into a vmhostd spec and comparing them with the spec the
    # daemon echoes. The daemon leaves out unset members, empty lists and empty hardware
    # classes when it echoes a spec (docs/api.md, "The VM spec"), so both sides are normalised
    # the same way before they are compared: string keys, no nil members, no empty lists or
    # objects, and whole-number strings turned into integers where the spec wants integers.
    # No spec rule is checked here: every rule lives in the daemon.
    module Spec
      # Spec members, by the type's attribute names. Everything but memory keeps its name.
      ATTRIBUTES = {
        role: 'role',
        cpu: 'cpu',
        memory: 'memory_mib',
        hardware: 'hardware',
        pci: 'pci',
        boot: 'boot',
        nics: 'nics',
        disks: 'disks',
        guest_interfaces: 'guest_interfaces',
        guest_exec: 'guest_exec',
        ssh: 'ssh',
        cpu_policy: 'cpu_policy',
        numa: 'numa',
        hugepages: 'hugepages',
        emulator_cpu: 'emulator_cpu',
        tpm: 'tpm'
      }.freeze

      # Members vmhostd leaves out of its views while they have their default: a VM whose view
      # lacks one has this value (docs/api.md, "The VM spec").
      IMPLIED = { guest_exec: true, cpu_policy: 'shared', emulator_cpu: false, tpm: false }.freeze

      # Members sent as JSON booleans: the type munges them to :true / :false.
      BOOLEANS = %i[guest_exec emulator_cpu tpm].freeze

      # The account `ssh` gets when it names none: vmhostd fills it in and echoes it, so a
      # declared `ssh` without `user` compares equal to the recorded one (docs/api.md).
      SSH_DEFAULT_USER = 'vmhost'

      # Members whose value is an integer in the spec, at any depth (`numa` when it names a
      # node: a whole-number string becomes that node, `auto` and the like stay strings).
      INTEGER_KEYS = %w[cpu memory_mib disk_gib size_gib vlan vlans vlan_id queues numa].freeze

      # A NIC's members at the values they have when not given (SpecDefaults::NIC).
      NIC_DEFAULTS = SpecDefaults::NIC

      # Statuses in which the VM counts as running (ensure => running is in sync).
      RUNNING_STATUSES = %w[running starting creating].freeze

      MEMORY_UNITS = { '' => 1, 'm' => 1, 'mib' => 1, 'g' => 1024, 'gib' => 1024 }.freeze

      module_function

      # A whole-number string as an Integer; anything else unchanged.
      def integerish(value)
        value.is_a?(String) && value.match?(/\A\d+\z/) ? Integer(value, 10) : value
      end

      # Memory in MiB from an Integer (MiB) or a string such as "512", "512M", "512MiB", "2G",
      # "2GiB". Returns nil for anything else (the type reports it).
      def memory_mib(value)
        return value if value.is_a?(Integer)
        return nil unless value.is_a?(String)

        m = value.strip.match(/\A(\d+)\s*([a-z]*)\z/i)
        return nil unless m

        factor = MEMORY_UNITS[m[2].downcase]
        factor && (Integer(m[1], 10) * factor)
      end

      # Normalises a value the way the daemon echoes it (see the module comment).
      def normalize(value, key = nil)
        case value
        when Hash then normalize_hash(value)
        when Array then value.map { |v| normalize(v, key) }
        when Symbol then value.to_s
        else INTEGER_KEYS.include?(key) ? integerish(value) : value
        end
      end

      def normalize_hash(hash)
        out = {}
        hash.each do |k, v|
          k = k.to_s
          v = k == 'hardware' ? normalize_hardware(v) : normalize(v, k)
          next if blank?(v)

          out[k] = v
        end
        out
      end

      # hardware: class => [indices]; indices are integers, empty classes are left out.
      def normalize_hardware(value)
        return normalize(value) unless value.is_a?(Hash)

        out = {}
        value.each do |cls, indices|
          indices = Array(indices).map { |i| integerish(i.is_a?(Symbol) ? i.to_s : i) }
          out[cls.to_s] = indices unless indices.empty?
        end
        out
      end

      def blank?(value)
        value.nil? || ((value.is_a?(Array) || value.is_a?(Hash)) && value.empty?)
      end

      # A spec member as the type's attribute sees it: the normalised value, or the empty
      # value of its shape when the daemon left it out.
      def attribute_value(spec, attr)
        key = ATTRIBUTES.fetch(attr)
        value = spec[key]
        case attr
        when :hardware, :boot then value.nil? ? {} : normalize(value, key)
        when :pci, :nics, :disks, :guest_interfaces then value.nil? ? [] : normalize(value, key)
        when :role then value.nil? ? :absent : value
        # vmhostd leaves these out of its views while they have their default.
        when *IMPLIED.keys then value.nil? ? IMPLIED[attr] : value
        else value.nil? ? :absent : normalize(value, key)
        end
      end

      # Whether a declared value (DESIRED) matches the daemon's (CURRENT) for ATTR.
      def same?(attr, current, desired)
        return current.nil? || current == :absent if desired.nil? || desired == :absent

        current = IMPLIED[attr] if IMPLIED.key?(attr) && (current.nil? || current == :absent)

        right = comparable(attr, desired)
        if current.nil? || current == :absent
          # The daemon leaves out empty members: absent is the empty value of the shape.
          return right.respond_to?(:empty?) && right.empty?
        end

        comparable(attr, current) == right
      end

      def comparable(attr, value)
        case attr
        when :hardware then normalize_hardware(value)
        when *BOOLEANS then boolean(value)
        when :ssh then ssh_with_user(normalize(value, 'ssh'))
        when :nics then normalize(value, 'nics').map { |nic| without_nic_defaults(nic) }
        when :boot then SpecDefaults.strip(normalize(value, 'boot'), SpecDefaults::BOOT)
        when :disks then normalize(value, 'disks').map { |disk| SpecDefaults.strip(disk, SpecDefaults::DISK) }
        else normalize(value, ATTRIBUTES.fetch(attr))
        end
      end

      # true / false from a Ruby boolean or the :true / :false (or 'true' / 'false') the type
      # munges `guest_exec`, `emulator_cpu` and `tpm` to; anything else unchanged (the daemon refuses it).
      def boolean(value)
        case value.to_s
        when 'true' then true
        when 'false' then false
        else value
        end
      end

      # A NIC as vmhostd echoes it: the members of NIC_DEFAULTS left out at their default.
      def without_nic_defaults(nic)
        SpecDefaults.strip(nic, NIC_DEFAULTS)
      end

      # `ssh` with the account vmhostd records when none is named.
      def ssh_with_user(value)
        return value if !value.is_a?(Hash) || value.empty? || value.key?('user')

        { 'user' => SSH_DEFAULT_USER }.merge(value)
      end

      # The full spec for vm.apply: the recorded spec (CURRENT, nil for a new VM) with every
      # declared attribute (DECLARED: attr => value) put over it, and the run state STATE
      # ('running' / 'stopped', nil to leave the recorded one or the daemon's default).
      def build(name, current, declared, state)
        spec = current.nil? ? {} : normalize(current)
        spec['name'] = name.to_s
        declared.each do |attr, value|
          key = ATTRIBUTES.fetch(attr)
          if value.nil? || value == :absent
            spec.delete(key)
          else
            spec[key] = BOOLEANS.include?(attr) ? boolean(value) : value
          end
        end
        if state.nil?
          spec.delete('state') if current.nil?
        else
          spec['state'] = state.to_s
        end
        normalize(spec)
      end

      # Members that are never drift: the run state converges by a start or stop, guest
      # interfaces are applied live by the guest agent and SSH access is written live by the
      # guest's exec server. (`guest_exec` is drift as vmhostd names it, but changes without a
      # restart.)
      NOT_DRIFT = %w[state guest_interfaces ssh].freeze

      # Dotted paths of the spec members that differ between two recorded specs (`cpu`,
      # `boot.image`), as vmhostd names them; `state`, `guest_interfaces` and `ssh` are not drift.
      def drift(old_spec, new_spec, path = nil)
        a = normalize(old_spec || {})
        b = normalize(new_spec || {})
        if path.nil?
          # Not Hash#except: that needs Ruby 3 (see docs/puppet.md on Ruby 2.7).
          NOT_DRIFT.each do |k|
            a.delete(k)
            b.delete(k)
          end
        end
        (a.keys | b.keys).sort.flat_map do |key|
          sub = path ? "#{path}.#{key}" : key
          if a[key].is_a?(Hash) && b[key].is_a?(Hash)
            drift(a[key], b[key], sub)
          else
            a[key] == b[key] ? [] : [sub]
          end
        end
      end

      # The type attribute a daemon error field (spec.memory_mib, spec.nics[0].ipv4) is about.
      def attribute_for_field(field)
        m = field.to_s.match(/\Aspec\.([a-z_]+)/)
        return nil unless m

        return 'ensure' if m[1] == 'state'
        return 'name' if m[1] == 'name'

        attr = ATTRIBUTES.key(m[1])
        attr&.to_s
      end
    end
  end
end
