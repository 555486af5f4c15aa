# frozen_string_literal: true

require_relative '../../puppet_x/vmhost/type_params'

Puppet::Type.newtype(:vmhost_snapshot) do
  @doc = <<~DOC
    A named snapshot of a VM's disks kept with the VM by vmhostd (docs/snapshots.md).

    `ensure => present` takes it when the VM has no snapshot of that name (`vm.snapshot`,
    running or stopped); an existing one is never retaken or compared: a snapshot is what the
    disks were when it was taken. `ensure => absent` deletes it (`vm.snapshot_delete`). Putting
    a VM back to a snapshot is an action, not a state: the function `vmhost::revert` (or the
    task `vmhost::revert`). Every rule (names, how many, consistency) is the daemon's; the type
    checks only the shape of each attribute.

        vmhost_snapshot { 'sensor1/before-upgrade':
          ensure   => present,
          requires => 'frozen',
        }
        vmhost_snapshot { 'old':
          ensure => absent,
          vm     => 'sensor1',
        }

    The title is `VM/SNAPSHOT`, or the snapshot's name with `vm` given. A snapshot requires
    (autorequire) the `vmhost_vm` of its VM when the catalog has one.
  DOC

  ensurable do
    desc <<~DOC
      `present` (default): the VM has a snapshot of that name (taken when it has none).
      `absent`: it has none (deleted; a VM that does not exist has none).
    DOC

    newvalue(:present) { provider.create }
    newvalue(:absent) { provider.destroy }

    defaultto :present
  end

  PuppetX::Vmhost::TypeParams.name_param(
    self, '`VM/SNAPSHOT`, or the snapshot\'s name when `vm` is given.'
  )

  newparam(:vm) do
    desc 'The VM. Default: the part of the title before `/`.'

    defaultto do
      name = @resource[:name].to_s
      name.include?('/') ? name.split('/', 2).first : nil
    end

    validate do |value|
      raise ArgumentError, "vm must be a non-empty string, not #{value.inspect}" unless
        value.is_a?(String) && !value.empty?
    end
  end

  newparam(:snapshot) do
    desc <<~DOC
      The snapshot's name (vmhostd checks its form: 1-64 of `A-Z a-z 0-9 . _ -`). Default: the
      part of the title after `/`, or the whole title.
    DOC

    defaultto do
      name = @resource[:name].to_s
      name.include?('/') ? name.split('/', 2).last : name
    end

    validate do |value|
      raise ArgumentError, "snapshot must be a non-empty string, not #{value.inspect}" unless
        value.is_a?(String) && !value.empty?
    end
  end

  newparam(:requires) do
    desc <<~DOC
      `frozen`: vmhostd refuses (4094) to take a running VM's snapshot that would be
      crash-consistent (its guest file systems not frozen), and the run fails. Only used when
      the snapshot is taken.
    DOC

    newvalues(:frozen)
  end

  newparam(:timeout_s) do
    desc <<~DOC
      The longest the copy may take, in seconds (`vm.snapshot`'s `timeout_s`; vmhostd's default
      3600). The provider waits that long plus 300 s.
    DOC

    validate do |value|
      ok = value.is_a?(Integer) || (value.is_a?(String) && value.match?(/\A\d+\z/))
      raise ArgumentError, "timeout_s must be a whole number of seconds, not #{value.inspect}" unless ok
    end
    munge { |value| Integer(value.to_s, 10) }
  end

  PuppetX::Vmhost::TypeParams.socket_param(self)

  validate do
    raise ArgumentError, "vmhost_snapshot[#{self[:name]}]: give vm, or a title 'VM/SNAPSHOT'" if self[:vm].nil?

    title = self[:name].to_s
    if title.include?('/') && title != "#{self[:vm]}/#{self[:snapshot]}"
      raise ArgumentError,
            "vmhost_snapshot[#{title}]: the title says #{title.inspect}, vm and snapshot say " \
            "#{"#{self[:vm]}/#{self[:snapshot]}".inspect}"
    end
  end

  autorequire(:vmhost_vm) { [self[:vm]] }
end
